//! `kvatlas serve` as a child process on loopback ports of its own choosing: what the demo and
//! the benchmarks run, reached as a router reaches it.

use std::collections::VecDeque;
use std::io::BufRead;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::time::{Duration, Instant};

/// How many lines of a server's log [`ServeChild::log_tail`] keeps.
const LOG_LINES: usize = 200;

/// A child's output, line by line, read on a thread of its own until the pipe closes — whether
/// or not anyone still receives (a child never blocks on a full pipe).
pub fn lines_of(output: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(output)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    rx
}

/// Why `kvatlas serve` could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The executable could not be run.
    #[error("starting {binary}: {source}")]
    Spawn {
        /// The executable.
        binary: String,
        /// Why.
        source: std::io::Error,
    },
    /// It exited, or never logged its addresses.
    #[error("kvatlas serve did not report its addresses within 30 s (it exited or is stuck)")]
    NoAddresses,
}

/// A running `kvatlas serve` child (killed when dropped; [`ServeChild::stop`] stops it
/// gracefully).
#[derive(Debug)]
pub struct ServeChild {
    child: Child,
    /// Its gRPC URL (`http://127.0.0.1:port`).
    pub url: String,
    /// Its HTTP address (`127.0.0.1:port`).
    pub http: String,
    /// The newest [`LOG_LINES`] lines of its log after the start line (warnings and errors:
    /// it logs at `warn`), for error messages.
    log: Arc<Mutex<VecDeque<String>>>,
}

impl ServeChild {
    /// Runs `binary serve --grpc-addr 127.0.0.1:0 --http-addr 127.0.0.1:0 ARGS…` (logging
    /// warnings and the server's start line) and waits until it logs the addresses it bound.
    /// Its log keeps being read (the newest lines kept for [`Self::log_tail`]), so it never
    /// blocks on a full pipe.
    ///
    /// # Errors
    /// If it cannot be started or does not report its addresses within 30 s.
    pub fn start(binary: &Path, args: &[String]) -> Result<Self, ServeError> {
        let mut child = Command::new(binary)
            .args([
                "serve",
                "--grpc-addr",
                "127.0.0.1:0",
                "--http-addr",
                "127.0.0.1:0",
            ])
            .args(args)
            .args(["--log", "warn,kvatlas_server::server=info"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| ServeError::Spawn {
                binary: binary.display().to_string(),
                source,
            })?;
        let Some(stderr) = child.stderr.take() else {
            return Err(stopped(child, ServeError::NoAddresses));
        };
        let rx = lines_of(stderr);
        let deadline = Instant::now() + Duration::from_secs(30);
        let addresses = || -> Option<(String, String)> {
            let line = loop {
                let left = deadline.saturating_duration_since(Instant::now());
                let line = rx.recv_timeout(left).ok()?;
                if line.contains("kvatlas serving") {
                    break line;
                }
            };
            let after = |marker: &str| -> Option<String> {
                let at = line.find(marker)? + marker.len();
                Some(
                    line[at..]
                        .split([',', ' '])
                        .next()
                        .unwrap_or_default()
                        .to_owned(),
                )
            };
            Some((after("gRPC on ")?, after("HTTP on ")?))
        };
        // A server that does not report its addresses is stopped, not left running (a
        // `Child` dropped is not killed): it kept its ports and its CPU for the next run.
        let Some((grpc, http)) = addresses() else {
            return Err(stopped(child, ServeError::NoAddresses));
        };
        let log = Arc::new(Mutex::new(VecDeque::new()));
        let kept = Arc::clone(&log);
        std::thread::spawn(move || {
            for line in rx {
                let mut kept = kept.lock().unwrap_or_else(PoisonError::into_inner);
                if kept.len() == LOG_LINES {
                    kept.pop_front();
                }
                kept.push_back(line);
            }
        });
        Ok(Self {
            child,
            url: format!("http://{grpc}"),
            http,
            log,
        })
    }

    /// The newest lines of its log since it started (at most 200).
    pub fn log_tail(&self) -> Vec<String> {
        self.log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .cloned()
            .collect()
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Stops it with SIGTERM (a graceful stop) and waits for it.
    pub fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

/// Kills `child`, waits for it, and hands back `error`.
fn stopped(mut child: std::process::Child, error: ServeError) -> ServeError {
    let _ = child.kill();
    let _ = child.wait();
    error
}

impl Drop for ServeChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
