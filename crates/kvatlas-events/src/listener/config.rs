//! What a listener is started with: [`ListenerConfig`] and its [`ListenerOptions`], and the
//! options' range checks.

use std::time::Duration;

use kvatlas_index::Worker;

use super::ListenerError;
use crate::convert::Source;
use crate::sequence::SequencerConfig;

/// Whether the listener's SUB connects to the engine or binds for engines that connect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum SocketMode {
    /// Connect to an engine's bound PUB (vLLM's default `tcp://*:5557`); reconnects forever.
    #[default]
    Connect,
    /// Bind, for engines configured with a connect endpoint (llm-d's centralized mode).
    Bind,
}

/// While the live stream stays quiet, the wait between probes doubles up to this many times
/// [`ListenerOptions::quiet_probe`].
pub(super) const MAX_PROBE_BACKOFF: u32 = 16;

/// Tuning of a listener's sockets and timeouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenerOptions {
    /// The longest its poller thread waits on the sockets before checking the listener's
    /// timeouts again (a stop or release wakes it at once). Default 100 ms.
    pub recv_timeout: Duration,
    /// A replay fails when no reply arrives for this long (per reply, not in total). Default 2 s.
    pub replay_timeout: Duration,
    /// First reconnection delay of the SUB and DEALER (`ZMQ_RECONNECT_IVL`). Default 100 ms.
    pub reconnect_interval: Duration,
    /// Maximum reconnection delay (`ZMQ_RECONNECT_IVL_MAX`, exponential backoff). Default 5 s.
    pub reconnect_interval_max: Duration,
    /// The SUB's receive high-water mark in messages (`ZMQ_RCVHWM`): how much libzmq buffers
    /// while the listener is backpressured before dropping (→ gap → replay). Default 10 000.
    /// Must be at least 1: libzmq takes 0 for "no limit", which would let a fast engine grow
    /// the buffer without bound while the listener is backpressured.
    pub receive_hwm: i32,
    /// Largest accepted frame in bytes (`ZMQ_MAXMSGSIZE`; a larger one drops the connection).
    /// Default 64 MiB.
    pub max_frame_bytes: i64,
    /// Live messages, and replay replies, read per wake-up before the poller thread serves its
    /// other listeners (this one is served again after them). Default 256.
    pub max_batches_per_wakeup: usize,
    /// The sequencer's buffer and duplicate window.
    pub sequencer: SequencerConfig,
    /// With a replay endpoint: when the live stream has been quiet this long, ask the engine
    /// for everything from the last batch applied on (a probe, [`Sequencer::probe`]), so a
    /// batch the live stream lost is found even if the engine publishes nothing after it, and
    /// so is an engine that restarted and went quiet (it no longer holds that batch). While the
    /// stream stays quiet the wait doubles, up to 16 × this. A probe is also made as soon as
    /// the SUB's connection is (re)established (what the engine published meanwhile was lost
    /// on the live stream), and once as soon as the listener has a position (to see that the
    /// engine keeps a ring), each once no other replay is outstanding. `None` turns probing
    /// off. Default 2 s.
    ///
    /// [`Sequencer::probe`]: crate::sequence::Sequencer::probe
    pub quiet_probe: Option<Duration>,
}

impl Default for ListenerOptions {
    fn default() -> Self {
        Self {
            recv_timeout: Duration::from_millis(100),
            replay_timeout: Duration::from_secs(2),
            reconnect_interval: Duration::from_millis(100),
            reconnect_interval_max: Duration::from_secs(5),
            receive_hwm: 10_000,
            max_frame_bytes: 64 << 20,
            max_batches_per_wakeup: 256,
            sequencer: SequencerConfig::default(),
            quiet_probe: Some(Duration::from_secs(2)),
        }
    }
}

/// Everything needed to start a listener for one source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerConfig {
    /// The registered source: worker id, data-parallel rank, block size, engine kind.
    pub source: Source,
    /// The engine's PUB endpoint (connect mode) or the endpoint to bind (bind mode), e.g.
    /// `tcp://10.0.0.5:5557`.
    pub endpoint: String,
    /// The engine's replay ROUTER endpoint; without it every gap resyncs.
    pub replay_endpoint: Option<String>,
    /// The SUB's topic prefix filter (empty = everything, vLLM's default topic is empty).
    pub topic: Vec<u8>,
    /// Connect (default) or bind.
    pub mode: SocketMode,
    /// Timeouts, buffers and limits.
    pub options: ListenerOptions,
    /// Continue a stream applied elsewhere up to this position (see [`Resume`]); `None` starts
    /// fresh.
    pub resume: Option<Resume>,
    /// Start held: buffer live batches, apply nothing until
    /// [`Listener::release`](super::Listener::release).
    pub hold: bool,
}

/// Where a listener continues a stream applied elsewhere: the checkpoint of a restored snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Resume {
    /// The sequence number of the last batch applied.
    pub position: u64,
    /// `(seq, fingerprint)` of the last batches applied, oldest first (to tell a batch already
    /// applied from a restarted engine's new one; see
    /// [`Sequencer::resume`](crate::sequence::Sequencer::resume)).
    pub recent: Vec<(u64, u64)>,
    /// Further ranks of the source's worker its batches fed before (a batch names its rank, and
    /// one publisher of a wide-EP deployment feeds many): a resync clears them with the
    /// registered rank, as it clears every rank the source fed since. The caller knows them
    /// from the state it resumes (the ranks of the worker holding blocks that no other source
    /// registers); ranks of another worker and those beyond [`MAX_RANKS_PER_SOURCE`] are
    /// ignored.
    ///
    /// [`MAX_RANKS_PER_SOURCE`]: super::MAX_RANKS_PER_SOURCE
    pub ranks: Vec<Worker>,
}

impl ListenerConfig {
    /// A connect-mode config without replay endpoint or topic filter, with default options.
    pub fn new(source: Source, endpoint: impl Into<String>) -> Self {
        Self {
            source,
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: Vec::new(),
            mode: SocketMode::Connect,
            options: ListenerOptions::default(),
            resume: None,
            hold: false,
        }
    }

    /// Sets the replay endpoint.
    pub fn with_replay_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.replay_endpoint = Some(endpoint.into());
        self
    }

    /// Sets the topic prefix filter.
    pub fn with_topic(mut self, topic: impl Into<Vec<u8>>) -> Self {
        self.topic = topic.into();
        self
    }

    /// Sets the socket mode.
    pub fn with_mode(mut self, mode: SocketMode) -> Self {
        self.mode = mode;
        self
    }

    /// Sets the options.
    pub fn with_options(mut self, options: ListenerOptions) -> Self {
        self.options = options;
        self
    }

    /// Continues a stream applied elsewhere (see [`Resume`]).
    pub fn with_resume(mut self, resume: Option<Resume>) -> Self {
        self.resume = resume;
        self
    }

    /// Starts held (see [`ListenerConfig::hold`]).
    pub fn held(mut self) -> Self {
        self.hold = true;
        self
    }
}

/// The socket durations of valid [`ListenerOptions`], in libzmq's milliseconds.
#[derive(Debug, Clone, Copy)]
pub(super) struct SocketMillis {
    /// [`ListenerOptions::recv_timeout`] (at least 1).
    pub(super) recv_timeout: i32,
    /// [`ListenerOptions::reconnect_interval`].
    pub(super) reconnect: i32,
    /// [`ListenerOptions::reconnect_interval_max`].
    pub(super) reconnect_max: i32,
}

impl ListenerOptions {
    /// Checks that every option is in range; returns the socket durations in milliseconds.
    ///
    /// # Errors
    /// [`ListenerError::InvalidOption`] for the first option out of range.
    pub(super) fn validate(&self) -> Result<SocketMillis, ListenerError> {
        let recv_timeout = millis_i32(self.recv_timeout, "recv_timeout")?;
        millis_i32(self.replay_timeout, "replay_timeout")?;
        let reconnect = millis_i32(self.reconnect_interval, "reconnect_interval")?;
        let reconnect_max = millis_i32(self.reconnect_interval_max, "reconnect_interval_max")?;
        if let Some(probe) = self.quiet_probe {
            let longest =
                probe
                    .checked_mul(MAX_PROBE_BACKOFF)
                    .ok_or(ListenerError::InvalidOption {
                        name: "quiet_probe",
                        reason: "too long",
                    })?;
            millis_i32(longest, "quiet_probe")?;
            if probe.is_zero() {
                return Err(ListenerError::InvalidOption {
                    name: "quiet_probe",
                    reason: "must be positive (None turns probing off)",
                });
            }
        }
        if recv_timeout == 0 {
            return Err(ListenerError::InvalidOption {
                name: "recv_timeout",
                reason: "must be at least 1 ms",
            });
        }
        if self.receive_hwm < 1 {
            return Err(ListenerError::InvalidOption {
                name: "receive_hwm",
                reason: "must be at least 1 (0 means no limit in libzmq: unbounded memory)",
            });
        }
        if self.max_frame_bytes < 1 {
            return Err(ListenerError::InvalidOption {
                name: "max_frame_bytes",
                reason: "must be positive",
            });
        }
        if self.max_batches_per_wakeup == 0 {
            return Err(ListenerError::InvalidOption {
                name: "max_batches_per_wakeup",
                reason: "must be at least 1",
            });
        }
        Ok(SocketMillis {
            recv_timeout,
            reconnect,
            reconnect_max,
        })
    }
}

pub(super) fn millis_i32(d: Duration, name: &'static str) -> Result<i32, ListenerError> {
    i32::try_from(d.as_millis()).map_err(|_| ListenerError::InvalidOption {
        name,
        reason: "longer than i32::MAX milliseconds",
    })
}
