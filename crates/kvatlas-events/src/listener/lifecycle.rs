//! One running listener, [`Listener`]: sets up its SUB on the caller's thread, hands it to a
//! poller thread, and reads its state, releases and stops it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::config::SocketMillis;
use super::event_loop::ListenerCore;
use super::poller::ListenerThreads;
use super::status::{Shared, SharedCounters};
use super::{
    ListenerConfig, ListenerError, ListenerId, ListenerState, ListenerStatus, MutationSink, Resume,
    SocketMode,
};
use crate::convert::Source;

/// One running listener: a ZMQ SUB (and a DEALER during replays) for one source, served by a
/// poller thread of a [`ListenerThreads`] set.
///
/// Dropping it stops it (see [`Listener::stop`]).
#[derive(Debug)]
pub struct Listener {
    id: ListenerId,
    source: Source,
    endpoint: String,
    shared: Arc<Shared>,
    threads: ListenerThreads,
    /// The poller it runs on, in `threads`.
    poller: usize,
    /// Disconnects once the poller has dropped the listener (`None` after it was waited for).
    done: Option<mpsc::Receiver<()>>,
}

impl Listener {
    /// Sets up the SUB (and checks the replay endpoint) on the caller's thread, so that a bad
    /// endpoint is reported here, then starts a thread of its own for it.
    ///
    /// # Errors
    /// [`ListenerError::Endpoint`] for an endpoint libzmq rejects, [`ListenerError::Socket`]
    /// if a socket cannot be configured, [`ListenerError::InvalidOption`] for an out-of-range
    /// option, [`ListenerError::Spawn`] if the thread cannot start.
    pub fn start(
        context: &zmq::Context,
        config: ListenerConfig,
        sink: Arc<dyn MutationSink>,
    ) -> Result<Self, ListenerError> {
        let name = format!(
            "kvatlas-listen-{}-{}",
            config.source.worker_id, config.source.dp_rank
        );
        let threads = ListenerThreads::new(1, &name)?;
        Self::start_on(context, &threads, ListenerId(0), config, sink)
    }

    /// As [`Listener::start`], on a poller thread of `threads` (the least loaded).
    pub(super) fn start_on(
        context: &zmq::Context,
        threads: &ListenerThreads,
        id: ListenerId,
        config: ListenerConfig,
        sink: Arc<dyn MutationSink>,
    ) -> Result<Self, ListenerError> {
        let options = &config.options;
        let SocketMillis {
            recv_timeout,
            reconnect,
            reconnect_max,
        } = options.validate()?;

        let socket = |what| move |source| ListenerError::Socket { what, source };
        let sub = context.socket(zmq::SUB).map_err(socket("create SUB"))?;
        sub.set_linger(0).map_err(socket("ZMQ_LINGER"))?;
        sub.set_rcvtimeo(recv_timeout)
            .map_err(socket("ZMQ_RCVTIMEO"))?;
        sub.set_rcvhwm(options.receive_hwm)
            .map_err(socket("ZMQ_RCVHWM"))?;
        sub.set_maxmsgsize(options.max_frame_bytes)
            .map_err(socket("ZMQ_MAXMSGSIZE"))?;
        sub.set_reconnect_ivl(reconnect)
            .map_err(socket("ZMQ_RECONNECT_IVL"))?;
        sub.set_reconnect_ivl_max(reconnect_max)
            .map_err(socket("ZMQ_RECONNECT_IVL_MAX"))?;
        sub.set_subscribe(&config.topic)
            .map_err(socket("ZMQ_SUBSCRIBE"))?;
        let endpoint_error = |endpoint: &str| {
            let endpoint = endpoint.to_owned();
            move |source| ListenerError::Endpoint { endpoint, source }
        };
        // Connection events (refused, retried, connected, disconnected) for `last_error`; a
        // listener without them still works, so a failure here is only logged.
        let monitor = match monitor_socket(context, &sub) {
            Ok(monitor) => Some(monitor),
            Err(error) => {
                tracing::warn!(
                    target: "kvatlas_events::listener",
                    "no connection monitor for {}: {error}",
                    config.endpoint
                );
                None
            }
        };
        let endpoint = match config.mode {
            SocketMode::Connect => {
                sub.connect(&config.endpoint)
                    .map_err(endpoint_error(&config.endpoint))?;
                config.endpoint.clone()
            }
            SocketMode::Bind => {
                sub.bind(&config.endpoint)
                    .map_err(endpoint_error(&config.endpoint))?;
                match sub.get_last_endpoint() {
                    Ok(Ok(bound)) => bound,
                    _ => config.endpoint.clone(),
                }
            }
        };
        if let Some(replay) = &config.replay_endpoint {
            // Validate now; each replay uses a fresh DEALER.
            let probe = context
                .socket(zmq::DEALER)
                .map_err(socket("create DEALER"))?;
            probe.set_linger(0).map_err(socket("ZMQ_LINGER"))?;
            probe.connect(replay).map_err(endpoint_error(replay))?;
        }

        let initial = if config.hold {
            ListenerStatus::Held
        } else {
            ListenerStatus::Pending
        };
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            status: AtomicU8::new(initial.as_u8()),
            last_seq: AtomicU64::new(config.resume.as_ref().map_or(u64::MAX, |r| r.position)),
            started: Instant::now(),
            last_batch_micros: AtomicU64::new(0),
            last_error: Mutex::new(None),
            counters: SharedCounters::default(),
            release: Mutex::new(None),
        });
        let source = config.source;
        let core = ListenerCore::new(
            context.clone(),
            config,
            sub,
            monitor,
            sink,
            Arc::clone(&shared),
        );
        let placement = threads.add(core)?;
        Ok(Self {
            id,
            source,
            endpoint,
            shared,
            threads: threads.clone(),
            poller: placement.poller,
            done: Some(placement.done),
        })
    }

    /// The listener's id (0 outside a registry).
    pub fn id(&self) -> ListenerId {
        self.id
    }

    /// The registered source.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// The SUB endpoint (in bind mode, the address actually bound).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Releases a listener started held ([`ListenerConfig::hold`]): it continues from `resume`
    /// (the checkpoint of the snapshot restored meanwhile) or from scratch, then applies the live
    /// batches it buffered — those the snapshot already holds are dropped as duplicates, a hole
    /// before them is replayed. Takes effect on its poller thread's next turn (it is woken); a
    /// listener not held ignores it.
    pub fn release(&self, resume: Option<Resume>) {
        *self.shared.release.lock() = Some(resume);
        self.threads.wake(self.poller);
    }

    /// The current state.
    pub fn state(&self) -> ListenerState {
        let last_seq = self.shared.last_seq.load(Ordering::Acquire);
        let last_batch = self.shared.last_batch_micros.load(Ordering::Relaxed);
        let since_last_batch = (last_batch > 0).then(|| {
            self.shared
                .started
                .elapsed()
                .saturating_sub(Duration::from_micros(last_batch - 1))
        });
        ListenerState {
            id: self.id,
            source: self.source,
            endpoint: self.endpoint.clone(),
            status: self.shared.status(),
            last_error: self.shared.last_error.lock().clone(),
            counters: self.shared.counters.snapshot(),
            last_seq: (last_seq != u64::MAX).then_some(last_seq),
            since_last_batch,
        }
    }

    /// Stops the listener and waits until its poller thread has dropped it (its sockets are
    /// closed; at most the mutation being handed over, or the sink's backpressure, delays it);
    /// returns the final state. The index keeps the source's blocks.
    pub fn stop(mut self) -> ListenerState {
        self.shutdown();
        self.state()
    }

    fn shutdown(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        let Some(done) = self.done.take() else {
            return;
        };
        self.threads.wake(self.poller);
        // Disconnects when the poller drops the listener (or its thread ends).
        let _ = done.recv();
        if self.shared.status() != ListenerStatus::Failed {
            self.shared.set_status(ListenerStatus::Stopped);
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Monitors `sub`'s connection events on a fresh inproc endpoint; returns the PAIR that
/// receives them.
fn monitor_socket(context: &zmq::Context, sub: &zmq::Socket) -> Result<zmq::Socket, zmq::Error> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let endpoint = format!(
        "inproc://kvatlas-listener-monitor-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let events = [
        zmq::SocketEvent::CONNECTED,
        zmq::SocketEvent::ACCEPTED,
        zmq::SocketEvent::HANDSHAKE_SUCCEEDED,
        zmq::SocketEvent::CONNECT_RETRIED,
        zmq::SocketEvent::DISCONNECTED,
        zmq::SocketEvent::HANDSHAKE_FAILED_NO_DETAIL,
        zmq::SocketEvent::HANDSHAKE_FAILED_PROTOCOL,
        zmq::SocketEvent::HANDSHAKE_FAILED_AUTH,
    ]
    .iter()
    .fold(0, |mask, event| mask | (*event as i32));
    sub.monitor(&endpoint, events)?;
    let pair = context.socket(zmq::PAIR)?;
    pair.set_linger(0)?;
    pair.connect(&endpoint)?;
    Ok(pair)
}
