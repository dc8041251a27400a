//! A real `nats-server` (Debian's 2.9) as a child process on a loopback port, with JetStream on
//! file storage in a temporary directory: what the NATS scale-out tests and benchmarks run.
//!
//! [`NatsServer::restart`] stops the server gracefully and starts it again on the same port and
//! the same store directory, so file-stored streams and buckets survive it, as they survive a
//! restart of a deployed server. The binary is found by [`NatsServer::binary`]; `cargo xtask ci`
//! installs it (`apt-get install nats-server`) when it is missing.

use std::collections::VecDeque;
use std::io::ErrorKind;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::server::lines_of;

/// The environment variable naming the `nats-server` executable to run (a path, or a name looked
/// up on `PATH`).
pub const BINARY_ENV: &str = "KVATLAS_NATS_SERVER";

/// Where Debian's `nats-server` package installs the binary (`/usr/sbin` is not on every user's
/// `PATH`).
const DEBIAN_BINARY: &str = "/usr/sbin/nats-server";

/// How to get a `nats-server`, for error messages.
const INSTALL_HINT: &str = "install it with `apt-get install nats-server` (Debian's 2.9), or run \
                            `cargo xtask ci`, which installs it; or set KVATLAS_NATS_SERVER to \
                            its path";

/// How long a start (or the start half of a restart) may take until the server is ready.
const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a graceful stop may take before the server is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// How many lines of the server's log are kept for error messages.
const LOG_LINES: usize = 200;

/// How many fresh ports [`NatsServer::start`] tries when another process takes the free port it
/// picked before the server binds it.
const PORT_ATTEMPTS: usize = 3;

/// Why a `nats-server` could not be found, started or restarted.
#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    /// No `nats-server` executable was found.
    #[error("nats-server not found ({searched}): {INSTALL_HINT}")]
    NotFound {
        /// Where it was looked for.
        searched: String,
    },
    /// Preparing the server (its port, its store directory) failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// The executable could not be run.
    #[error("starting {binary}: {source} ({INSTALL_HINT})")]
    Spawn {
        /// The executable.
        binary: String,
        /// Why.
        source: std::io::Error,
    },
    /// The server exited before it was ready.
    #[error("nats-server on port {port} exited ({status}) before it was ready; its log:\n{log}")]
    Exited {
        /// The port it was given.
        port: u16,
        /// How it exited.
        status: ExitStatus,
        /// The last lines of its log.
        log: String,
    },
    /// The server did not accept connections and log "Server is ready" in time.
    #[error("nats-server on port {port} was not ready within {secs} s; its log:\n{log}")]
    NotReady {
        /// The port it was given.
        port: u16,
        /// The time it was given.
        secs: u64,
        /// The last lines of its log.
        log: String,
    },
    /// The server did not log that it reloaded its configuration in time (it refused the
    /// new text, or it does not run).
    #[error("nats-server on port {port} did not reload its configuration; its log:\n{log}")]
    NotReloaded {
        /// Its port.
        port: u16,
        /// The last lines of its log.
        log: String,
    },
}

/// The log of one run of the server: its last [`LOG_LINES`] lines, and whether it said it is
/// ready.
#[derive(Debug, Default)]
struct RunLog {
    lines: VecDeque<String>,
    ready: bool,
    /// The server's output has ended (it exited): the log is complete.
    closed: bool,
}

impl RunLog {
    fn tail(log: &Mutex<Self>) -> Vec<String> {
        let log = log.lock().unwrap_or_else(PoisonError::into_inner);
        log.lines.iter().cloned().collect()
    }
}

/// A running `nats-server` with JetStream on file storage, on a loopback port of its own, with a
/// temporary store directory (killed, and the directory removed, when dropped).
///
/// ```no_run
/// # fn main() -> Result<(), kvatlas_fleet::nats::NatsError> {
/// use kvatlas_fleet::nats::NatsServer;
///
/// let mut nats = NatsServer::start()?;
/// let url = nats.url(); // nats://127.0.0.1:PORT, for async-nats
/// // … create streams, publish …
/// nats.restart()?; // same port, same store: file-stored streams survive
/// # let _ = url;
/// # Ok(())
/// # }
/// ```
pub struct NatsServer {
    binary: PathBuf,
    port: u16,
    store: PathBuf,
    /// A configuration file given with `-c` (written into the store directory), if any.
    config: Option<PathBuf>,
    child: Option<Child>,
    log: Arc<Mutex<RunLog>>,
}

impl std::fmt::Debug for NatsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsServer")
            .field("binary", &self.binary)
            .field("port", &self.port)
            .field("store", &self.store)
            .field("pid", &self.pid())
            .finish_non_exhaustive()
    }
}

impl NatsServer {
    /// The `nats-server` executable: `KVATLAS_NATS_SERVER` if set (a path, or a name looked up
    /// on `PATH`), else `nats-server` on `PATH`, else Debian's `/usr/sbin/nats-server`.
    ///
    /// # Errors
    /// [`NatsError::NotFound`] (with how to install it) if there is none.
    pub fn binary() -> Result<PathBuf, NatsError> {
        if let Some(value) = std::env::var_os(BINARY_ENV).filter(|v| !v.is_empty()) {
            let path = PathBuf::from(&value);
            if path.components().count() > 1 {
                if is_executable(&path) {
                    return Ok(path);
                }
                return Err(NatsError::NotFound {
                    searched: format!("{BINARY_ENV}={} is not an executable", path.display()),
                });
            }
            return on_path(&path).ok_or_else(|| NatsError::NotFound {
                searched: format!("{BINARY_ENV}={} is not on PATH", path.display()),
            });
        }
        if let Some(found) = on_path(Path::new("nats-server")) {
            return Ok(found);
        }
        let debian = PathBuf::from(DEBIAN_BINARY);
        if is_executable(&debian) {
            return Ok(debian);
        }
        Err(NatsError::NotFound {
            searched: format!("{BINARY_ENV} unset, not on PATH, not at {DEBIAN_BINARY}"),
        })
    }

    /// Runs `nats-server -a 127.0.0.1 -p PORT -js -sd DIR` on a free loopback port with a fresh
    /// temporary store directory, and waits (at most 10 s) until it accepts connections and
    /// logs that it is ready. Its output is drained on a thread for as long as it runs (the last
    /// 200 lines are kept for error messages and [`NatsServer::log_tail`]).
    ///
    /// # Errors
    /// If there is no binary ([`NatsServer::binary`]), no free port or temporary directory, or
    /// the server exits or is not ready in time.
    pub fn start() -> Result<Self, NatsError> {
        Self::start_configured(None)
    }

    /// As [`NatsServer::start`], with the server's `max_payload` (the largest message it
    /// takes, 1 MiB by default) set to `bytes` in a configuration file.
    ///
    /// # Errors
    /// As [`NatsServer::start`], or if the file cannot be written.
    pub fn start_with_max_payload(bytes: u32) -> Result<Self, NatsError> {
        Self::start_configured(Some(format!("max_payload: {bytes}\n")))
    }

    /// As [`NatsServer::start`], with `config` (nats-server's configuration syntax: an
    /// `authorization` or `tls` block, …) in a configuration file in its store directory.
    /// The command line's address, port and JetStream store still apply.
    ///
    /// # Errors
    /// As [`NatsServer::start`], or if the file cannot be written.
    pub fn start_with_config(config: &str) -> Result<Self, NatsError> {
        Self::start_configured(Some(config.to_owned()))
    }

    /// Replaces the configuration file's text with `config` and has the running server reload
    /// it (SIGHUP): changed credentials are enforced at once (nats-server disconnects the
    /// clients whose credentials it no longer accepts). Returns when the server logged that it
    /// reloaded (at most 10 s).
    ///
    /// # Errors
    /// If the server was not started with a configuration file or does not run, the file cannot
    /// be written, or the server does not log the reload in time (its log in the error).
    pub fn reload_config(&mut self, config: &str) -> Result<(), NatsError> {
        let (Some(path), Some(pid)) = (self.config.clone(), self.pid()) else {
            return Err(NatsError::NotReloaded {
                port: self.port,
                log: "(no running server started with a configuration file)".into(),
            });
        };
        std::fs::write(&path, config).map_err(|source| NatsError::Io {
            what: format!("writing {}", path.display()),
            source,
        })?;
        let reloads = || {
            self.log_tail()
                .iter()
                .filter(|line| line.contains("Reloaded server configuration"))
                .count()
        };
        let before = reloads();
        let _ = Command::new("kill")
            .args(["-HUP", &pid.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + READY_TIMEOUT;
        while reloads() == before {
            if Instant::now() >= deadline {
                return Err(NatsError::NotReloaded {
                    port: self.port,
                    log: self.log_tail().join("\n"),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    fn start_configured(config: Option<String>) -> Result<Self, NatsError> {
        let binary = Self::binary()?;
        let store = temp_store()?;
        let config = match config {
            Some(text) => {
                let path = store.join("nats-server.conf");
                std::fs::write(&path, text).map_err(|source| NatsError::Io {
                    what: format!("writing {}", path.display()),
                    source,
                })?;
                Some(path)
            }
            None => None,
        };
        let mut server = Self {
            binary,
            port: 0,
            store,
            config,
            child: None,
            log: Arc::default(),
        };
        // The port is free when picked, but another process may bind it before the server does:
        // then the server exits at once, and a fresh port is tried.
        let mut attempts = 1;
        loop {
            server.port = free_port()?;
            match server.spawn_and_wait() {
                Ok(()) => return Ok(server),
                Err(NatsError::Exited { .. })
                    if attempts < PORT_ATTEMPTS && server.port_taken() =>
                {
                    attempts += 1;
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// Its client URL, `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Its client port on 127.0.0.1 (the same across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its JetStream store directory (the same across restarts; removed when dropped).
    pub fn store_dir(&self) -> &Path {
        &self.store
    }

    /// The process id of the running server, if it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The last lines (at most 200) the current (or last) run of the server logged.
    pub fn log_tail(&self) -> Vec<String> {
        RunLog::tail(&self.log)
    }

    /// Whether the server is running (started, not stopped or killed, and has not exited).
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(None)) => true,
            Some(Ok(Some(_)) | Err(_)) | None => false,
        }
    }

    /// Stops the server gracefully (SIGTERM: it flushes and closes its stores) and waits for it
    /// to exit; after 10 s it is killed. Nothing happens if it does not run.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            match child.try_wait() {
                Ok(Some(_)) | Err(_) => return,
                Ok(None) if Instant::now() >= deadline => break,
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Kills the server (SIGKILL: a crash, nothing flushed) and waits for it to exit. Nothing
    /// happens if it does not run.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the server gracefully ([`NatsServer::stop`]; nothing to stop after
    /// [`NatsServer::kill`]) and starts it again on the same port with the same store directory,
    /// so file-stored streams survive; waits (at most 10 s) until it is ready again.
    ///
    /// # Errors
    /// If the server exits or is not ready in time (for example because another process took
    /// its port while it was down).
    pub fn restart(&mut self) -> Result<(), NatsError> {
        self.stop();
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            match self.spawn_and_wait() {
                // The old listening socket may linger for a moment after the old process exited.
                Err(NatsError::Exited { .. }) if Instant::now() < deadline && self.port_taken() => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                result => return result,
            }
        }
    }

    /// Stops the server, empties its store directory and starts it again on the same port: a
    /// server that lost its storage (every stream and bucket is gone; clients reconnect to an
    /// empty JetStream). Waits (at most 10 s) until it is ready again.
    ///
    /// # Errors
    /// If the store cannot be emptied, or the server does not start again ([`Self::restart`]).
    pub fn restart_losing_storage(&mut self) -> Result<(), NatsError> {
        self.stop();
        let jetstream = self.store.join("jetstream");
        if jetstream.exists() {
            std::fs::remove_dir_all(&jetstream).map_err(|source| NatsError::Io {
                what: format!("emptying nats-server's store {}", jetstream.display()),
                source,
            })?;
        }
        self.restart()
    }

    /// Whether the current run's log says that its port was taken.
    fn port_taken(&self) -> bool {
        self.log_tail()
            .iter()
            .any(|line| line.contains("address already in use"))
    }

    /// Spawns the server on `self.port` and `self.store` (with a fresh log) and waits until it
    /// is ready; on failure it is killed and `self.child` is `None`.
    fn spawn_and_wait(&mut self) -> Result<(), NatsError> {
        debug_assert!(self.child.is_none(), "one server at a time");
        let (reader, writer) = std::io::pipe().map_err(|source| NatsError::Io {
            what: "creating a pipe for nats-server's output".into(),
            source,
        })?;
        let stderr = writer.try_clone().map_err(|source| NatsError::Io {
            what: "creating a pipe for nats-server's output".into(),
            source,
        })?;
        // stdout and stderr share one pipe, so the log keeps their order; the command (holding
        // the write ends) is dropped after the spawn, so the reader ends when the server does.
        let mut command = Command::new(&self.binary);
        if let Some(config) = &self.config {
            command.arg("-c").arg(config);
        }
        let child = command
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&self.store)
            .stdin(Stdio::null())
            .stdout(writer)
            .stderr(stderr)
            .spawn()
            .map_err(|source| NatsError::Spawn {
                binary: self.binary.display().to_string(),
                source,
            })?;
        self.child = Some(child);
        let log = Arc::new(Mutex::new(RunLog::default()));
        self.log = Arc::clone(&log);
        let lines = lines_of(reader);
        std::thread::spawn(move || {
            for line in lines {
                let mut log = log.lock().unwrap_or_else(PoisonError::into_inner);
                log.ready |= line.contains("Server is ready");
                if log.lines.len() == LOG_LINES {
                    log.lines.pop_front();
                }
                log.lines.push_back(line);
            }
            log.lock().unwrap_or_else(PoisonError::into_inner).closed = true;
        });
        let result = self.wait_ready();
        if result.is_err() {
            self.kill();
        }
        result
    }

    /// Waits until the server accepts a TCP connection and has logged "Server is ready".
    fn wait_ready(&mut self) -> Result<(), NatsError> {
        let address = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                // Let the drain thread take the last lines of the log (its reason to exit).
                let drained = Instant::now() + Duration::from_secs(1);
                while !self
                    .log
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .closed
                    && Instant::now() < drained
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                return Err(NatsError::Exited {
                    port: self.port,
                    status,
                    log: self.log_tail().join("\n"),
                });
            }
            let ready = self
                .log
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .ready;
            if ready && TcpStream::connect_timeout(&address, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(NatsError::NotReady {
                    port: self.port,
                    secs: READY_TIMEOUT.as_secs(),
                    log: self.log_tail().join("\n"),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.store);
    }
}

/// A loopback port that was free a moment ago (bound to port 0, read, released).
fn free_port() -> Result<u16, NatsError> {
    let io = |source| NatsError::Io {
        what: "picking a free loopback port".into(),
        source,
    };
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(io)?;
    Ok(listener.local_addr().map_err(io)?.port())
}

/// A fresh, empty directory under the system's temporary directory for the JetStream store.
fn temp_store() -> Result<PathBuf, NatsError> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let base = std::env::temp_dir();
    loop {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = base.join(format!(
            "kvatlas-nats-{}-{}-{nanos:08x}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(error) if error.kind() == ErrorKind::AlreadyExists => {}
            Err(source) => {
                return Err(NatsError::Io {
                    what: format!("creating the store directory {}", dir.display()),
                    source,
                });
            }
        }
    }
}

/// `name` in the first directory of `PATH` holding it as an executable.
fn on_path(name: &Path) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
}

/// Whether `path` is a file someone may execute.
fn is_executable(path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        path.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    }
    #[cfg(not(unix))]
    {
        path.is_file()
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader};

    use super::*;

    /// Connects to the server and reads its greeting: a NATS `INFO` line with JetStream on.
    fn greet(nats: &NatsServer) {
        let stream =
            TcpStream::connect(("127.0.0.1", nats.port())).expect("connecting to nats-server");
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("a read timeout");
        let mut info = String::new();
        BufReader::new(stream)
            .read_line(&mut info)
            .expect("nats-server's INFO line");
        assert!(info.starts_with("INFO {"), "not a NATS greeting: {info:?}");
        assert!(info.contains(r#""jetstream":true"#), "no JetStream: {info}");
    }

    /// Needs a real nats-server: fails (with the install hint) rather than skipping without one.
    #[test]
    fn nats_server_starts_restarts_on_the_same_port_and_cleans_up() {
        let mut nats = NatsServer::start().unwrap_or_else(|error| panic!("{error}"));
        assert!(nats.is_running());
        let port = nats.port();
        let store = nats.store_dir().to_path_buf();
        assert_eq!(nats.url(), format!("nats://127.0.0.1:{port}"));
        greet(&nats);
        assert!(
            store.join("jetstream").is_dir(),
            "JetStream stores in {store:?}"
        );

        nats.restart().unwrap_or_else(|error| panic!("{error}"));
        assert!(nats.is_running());
        assert_eq!((nats.port(), nats.store_dir()), (port, store.as_path()));
        greet(&nats);
        assert!(
            nats.log_tail()
                .iter()
                .any(|l| l.contains("Server is ready"))
        );

        nats.kill();
        assert!(!nats.is_running());
        nats.restart().unwrap_or_else(|error| panic!("{error}"));
        greet(&nats);

        std::fs::write(store.join("jetstream").join("marker"), b"x").expect("a file in the store");
        nats.restart_losing_storage()
            .unwrap_or_else(|error| panic!("{error}"));
        greet(&nats);
        assert!(
            !store.join("jetstream").join("marker").exists(),
            "the store was emptied"
        );
        assert_eq!(nats.port(), port);

        drop(nats);
        assert!(!store.exists(), "the store directory is removed on drop");
    }

    #[test]
    fn a_missing_binary_says_how_to_install_it() {
        let error = NatsError::NotFound {
            searched: "nowhere".into(),
        };
        assert!(error.to_string().contains("apt-get install nats-server"));
        assert!(error.to_string().contains("cargo xtask ci"));
    }
}
