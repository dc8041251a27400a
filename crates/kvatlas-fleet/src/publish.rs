//! The fleet's sockets: per engine a ZMQ XPUB sending `[topic, seq (8 bytes big-endian),
//! payload]` as vLLM's publisher does, and a ROUTER serving replays from any sequence number as
//! vLLM's replay socket does — bound on loopback, one pair per simulated engine.
//!
//! An XPUB is a PUB that also reports its subscribers: [`Publishers::wait_subscribed`] lets a
//! simulation start publishing only once the indexer listens to every engine, so nothing is lost
//! to ZMQ's slow-joiner window. Every payload published is kept (the replay history), so an
//! indexer that sees a gap gets every batch back — or, with [`Publishers::bind_with_ring`], the
//! newest N, as vLLM's bounded replay buffer keeps them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The topic every engine publishes on (vLLM's default is empty; a topic checks that the
/// subscriber's filter and the replay's topic frames are read right).
pub const TOPIC: &[u8] = b"kv-events";

/// Why the fleet's sockets failed.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// A ZMQ call failed.
    #[error("zmq: {0}")]
    Zmq(#[from] zmq::Error),
    /// A bound socket reported an endpoint that is not UTF-8.
    #[error("a socket endpoint is not UTF-8")]
    Endpoint,
    /// Not every engine got its subscribers in time.
    #[error("engine {worker} has {seen} of {wanted} subscribers after {waited:?}")]
    NotSubscribed {
        /// The engine.
        worker: u32,
        /// Subscriptions seen.
        seen: usize,
        /// Subscriptions wanted.
        wanted: usize,
        /// How long it waited.
        waited: Duration,
    },
    /// The replay server thread failed.
    #[error("the replay server failed: {0}")]
    Replay(String),
}

/// Where an indexer reaches one engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoints {
    /// The worker (engine instance) id.
    pub worker: u32,
    /// The live PUB endpoint (`tcp://127.0.0.1:port`).
    pub live: String,
    /// The replay ROUTER endpoint.
    pub replay: String,
}

/// Per engine, the payloads it can still replay.
type History = Arc<Mutex<Vec<Ring>>>;

/// One engine's replay history: every payload it published, or the newest `limit` of them as
/// vLLM's bounded replay buffer keeps.
#[derive(Debug, Clone, Default)]
struct Ring {
    /// The sequence number of `batches[0]`.
    first: u64,
    batches: std::collections::VecDeque<Arc<[u8]>>,
    limit: Option<usize>,
}

impl Ring {
    /// Appends the next batch; returns its sequence number.
    fn push(&mut self, payload: Arc<[u8]>) -> u64 {
        self.batches.push_back(payload);
        let seq = self.first + self.batches.len() as u64 - 1;
        if self.limit.is_some_and(|limit| self.batches.len() > limit) {
            self.batches.pop_front();
            self.first += 1;
        }
        seq
    }

    /// The batches from `start` on (from the oldest kept if `start` is older), with their
    /// sequence numbers.
    fn from(&self, start: u64) -> Vec<(u64, Arc<[u8]>)> {
        let skip = usize::try_from(start.saturating_sub(self.first)).unwrap_or(usize::MAX);
        self.batches
            .iter()
            .enumerate()
            .skip(skip)
            .map(|(i, p)| (self.first + i as u64, Arc::clone(p)))
            .collect()
    }
}

/// The fleet's sockets and its replay server.
pub struct Publishers {
    publishers: Vec<zmq::Socket>,
    endpoints: Vec<Endpoints>,
    history: History,
    stop: Arc<AtomicBool>,
    replays: Arc<AtomicU64>,
    replay: Option<JoinHandle<Result<(), PublishError>>>,
    _context: zmq::Context,
}

impl std::fmt::Debug for Publishers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publishers")
            .field("endpoints", &self.endpoints)
            .finish_non_exhaustive()
    }
}

fn bound(socket: &zmq::Socket) -> Result<String, PublishError> {
    socket.bind("tcp://127.0.0.1:0")?;
    socket
        .get_last_endpoint()?
        .map_err(|_| PublishError::Endpoint)
}

impl Publishers {
    /// Binds an XPUB and a ROUTER on loopback for each of `workers` engines (ids
    /// `0..workers`) and starts serving replays of everything published.
    ///
    /// # Errors
    /// If a socket cannot be created or bound.
    pub fn bind(workers: u32) -> Result<Self, PublishError> {
        Self::bind_with_ring(workers, None)
    }

    /// As [`Publishers::bind`], each engine keeping only its newest `ring` batches for replay
    /// (`None`: all), as vLLM's bounded replay buffer does: a replay asked from an older batch
    /// starts at the oldest one kept.
    ///
    /// # Errors
    /// If a socket cannot be created or bound.
    pub fn bind_with_ring(workers: u32, ring: Option<usize>) -> Result<Self, PublishError> {
        let context = zmq::Context::new();
        let mut publishers = Vec::new();
        let mut routers = Vec::new();
        let mut endpoints = Vec::new();
        for worker in 0..workers {
            let publisher = context.socket(zmq::XPUB)?;
            publisher.set_sndhwm(0)?;
            publisher.set_xpub_verbose(true)?;
            publisher.set_linger(0)?;
            let live = bound(&publisher)?;
            let router = context.socket(zmq::ROUTER)?;
            router.set_linger(0)?;
            let replay = bound(&router)?;
            publishers.push(publisher);
            routers.push(router);
            endpoints.push(Endpoints {
                worker,
                live,
                replay,
            });
        }
        let history: History = Arc::new(Mutex::new(vec![
            Ring {
                limit: ring,
                ..Ring::default()
            };
            workers as usize
        ]));
        let stop = Arc::new(AtomicBool::new(false));
        let replays = Arc::new(AtomicU64::new(0));
        let replay = {
            let (history, stop, replays) = (
                Arc::clone(&history),
                Arc::clone(&stop),
                Arc::clone(&replays),
            );
            std::thread::Builder::new()
                .name("fleet-replay".into())
                .spawn(move || serve_replays(&routers, &history, &stop, &replays))
                .map_err(|e| PublishError::Replay(e.to_string()))?
        };
        Ok(Self {
            publishers,
            endpoints,
            history,
            stop,
            replays,
            replay: Some(replay),
            _context: context,
        })
    }

    /// Every engine's endpoints, by worker id.
    pub fn endpoints(&self) -> &[Endpoints] {
        &self.endpoints
    }

    /// Waits until every engine's publisher has `subscribers` subscriptions.
    ///
    /// # Errors
    /// If some engine has fewer when `timeout` runs out.
    pub fn wait_subscribed(
        &self,
        subscribers: usize,
        timeout: Duration,
    ) -> Result<(), PublishError> {
        let deadline = Instant::now() + timeout;
        for (worker, publisher) in self.publishers.iter().enumerate() {
            let mut seen = 0;
            while seen < subscribers {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(PublishError::NotSubscribed {
                        worker: worker as u32,
                        seen,
                        wanted: subscribers,
                        waited: timeout,
                    });
                }
                if publisher.poll(zmq::POLLIN, left.as_millis().max(1) as i64)? > 0 {
                    let message = publisher.recv_bytes(0)?;
                    if message.first() == Some(&1) {
                        seen += 1;
                    }
                }
            }
        }
        Ok(())
    }

    /// Publishes `payload` as engine `worker`'s next batch; returns its sequence number.
    ///
    /// # Errors
    /// If the send fails.
    ///
    /// # Panics
    /// If `worker` is not one of the fleet's engines.
    pub fn publish(&self, worker: u32, payload: Arc<[u8]>) -> Result<u64, PublishError> {
        let seq = {
            let mut history = self
                .history
                .lock()
                .map_err(|_| PublishError::Replay("the replay server panicked".into()))?;
            history[worker as usize].push(Arc::clone(&payload))
        };
        let publisher = &self.publishers[worker as usize];
        publisher.send(TOPIC, zmq::SNDMORE)?;
        publisher.send(&seq.to_be_bytes()[..], zmq::SNDMORE)?;
        publisher.send(&payload[..], 0)?;
        Ok(seq)
    }

    /// Replay requests taken so far, counted before their answer is sent: each a gap an
    /// indexer saw, or kvatlas's one request per engine for its position as it subscribes.
    pub fn replays_served(&self) -> u64 {
        self.replays.load(Ordering::Relaxed)
    }

    /// Stops the replay server and closes every socket.
    ///
    /// # Errors
    /// If the replay server failed.
    pub fn stop(mut self) -> Result<(), PublishError> {
        self.stop.store(true, Ordering::Relaxed);
        match self.replay.take() {
            Some(handle) => handle
                .join()
                .map_err(|_| PublishError::Replay("the replay server panicked".into()))?,
            None => Ok(()),
        }
    }
}

impl Drop for Publishers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Answers replay requests (`[identity, "", start_seq]`) on every engine's ROUTER with that
/// engine's published batches from `start_seq` on, as `[identity, "", topic, seq, payload]`,
/// then the end marker (sequence `u64::MAX`, empty payload).
fn serve_replays(
    routers: &[zmq::Socket],
    history: &Mutex<Vec<Ring>>,
    stop: &AtomicBool,
    served: &AtomicU64,
) -> Result<(), PublishError> {
    while !stop.load(Ordering::Relaxed) {
        let mut items: Vec<zmq::PollItem<'_>> = routers
            .iter()
            .map(|r| r.as_poll_item(zmq::POLLIN))
            .collect();
        if zmq::poll(&mut items, 50)? == 0 {
            continue;
        }
        let ready: Vec<usize> = items
            .iter()
            .enumerate()
            .filter(|(_, item)| item.is_readable())
            .map(|(w, _)| w)
            .collect();
        for worker in ready {
            let router = &routers[worker];
            let frames = router.recv_multipart(0)?;
            // As vLLM: anything but [identity, b"", start] is ignored (a malformed request of
            // kvatlas's would time out against real engines, so it must here too).
            let [identity, _, start] = frames.as_slice() else {
                continue;
            };
            let Ok(start) = <[u8; 8]>::try_from(start.as_slice()).map(u64::from_be_bytes) else {
                continue;
            };
            // Counted before the answer goes out: whoever has read the whole answer sees it
            // counted (counted after, a test reading the count right after the end marker
            // could find it not counted yet).
            served.fetch_add(1, Ordering::Relaxed);
            let batches = match history.lock() {
                Ok(history) => history[worker].from(start),
                Err(_) => return Err(PublishError::Replay("the history lock is poisoned".into())),
            };
            for (seq, payload) in &batches {
                router.send_multipart(
                    [
                        identity.as_slice(),
                        b"",
                        TOPIC,
                        &seq.to_be_bytes(),
                        &payload[..],
                    ],
                    0,
                )?;
            }
            // vLLM ≥ 0.26's end marker carries an empty topic frame (docs/events.md §7.4).
            router.send_multipart(
                [identity.as_slice(), b"", b"", &u64::MAX.to_be_bytes(), b""],
                0,
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bounded_ring_keeps_the_newest_batches_with_their_numbers() {
        let mut ring = Ring {
            limit: Some(2),
            ..Ring::default()
        };
        for i in 0u8..5 {
            assert_eq!(ring.push(Arc::from(vec![i])), u64::from(i));
        }
        let replayed = |start| -> Vec<(u64, Vec<u8>)> {
            ring.from(start)
                .into_iter()
                .map(|(seq, payload)| (seq, payload.to_vec()))
                .collect()
        };
        assert_eq!(
            replayed(0),
            [(3, vec![3]), (4, vec![4])],
            "from the oldest kept"
        );
        assert_eq!(replayed(4), [(4, vec![4])]);
        assert!(replayed(5).is_empty());
        let mut all = Ring::default();
        for i in 0u8..5 {
            all.push(Arc::from(vec![i]));
        }
        assert_eq!(all.from(1).len(), 4);
    }

    #[test]
    fn a_subscriber_gets_live_batches_and_replays_from_any_sequence() {
        let publishers = Publishers::bind(1).expect("bind on loopback");
        let endpoints = publishers.endpoints()[0].clone();
        let context = zmq::Context::new();
        let sub = context.socket(zmq::SUB).expect("a SUB");
        sub.connect(&endpoints.live).expect("connect");
        sub.set_subscribe(b"").expect("subscribe");
        sub.set_rcvtimeo(5_000).expect("timeout");
        publishers
            .wait_subscribed(1, Duration::from_secs(5))
            .expect("the subscription arrives");
        for payload in [&b"first"[..], b"second", b"third"] {
            publishers.publish(0, payload.into()).expect("publish");
        }
        for (seq, payload) in [(0u64, &b"first"[..]), (1, b"second"), (2, b"third")] {
            let frames = sub.recv_multipart(0).expect("a live batch");
            assert_eq!(
                frames,
                vec![TOPIC.to_vec(), seq.to_be_bytes().to_vec(), payload.to_vec()]
            );
        }
        let dealer = context.socket(zmq::DEALER).expect("a DEALER");
        dealer.set_rcvtimeo(5_000).expect("timeout");
        dealer.connect(&endpoints.replay).expect("connect");
        // As vLLM, a request of other frames than [b"", start] is ignored (answered, it hid a
        // request real engines drop).
        dealer
            .send_multipart([&b""[..], b"extra", &0u64.to_be_bytes()], 0)
            .expect("a malformed request");
        dealer
            .send_multipart([&b""[..], &1u64.to_be_bytes()], 0)
            .expect("ask from seq 1");
        let mut replayed = Vec::new();
        loop {
            let frames = dealer.recv_multipart(0).expect("a reply");
            assert_eq!(frames.len(), 4, "[\"\", topic, seq, payload]");
            if frames[3].is_empty() {
                assert_eq!(frames[2], u64::MAX.to_be_bytes());
                assert!(frames[1].is_empty(), "vLLM's end marker has an empty topic");
                break;
            }
            replayed.push((frames[2].clone(), frames[3].clone()));
        }
        assert_eq!(
            replayed,
            vec![
                (1u64.to_be_bytes().to_vec(), b"second".to_vec()),
                (2u64.to_be_bytes().to_vec(), b"third".to_vec())
            ]
        );
        assert_eq!(publishers.replays_served(), 1);
        publishers.stop().expect("stops");
    }
}
