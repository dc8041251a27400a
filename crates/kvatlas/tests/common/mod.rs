//! Shared by the binary's tests: `kvatlas serve` as a child process on ephemeral loopback ports.

#![allow(dead_code, unreachable_pub)] // each test binary uses a part

pub mod fleet;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_kvatlas");
/// Bound on waiting for the server's first log lines.
const WAIT: Duration = Duration::from_secs(20);

/// A running `kvatlas serve` and the addresses it logged.
pub struct Served {
    pub child: Child,
    pub grpc: String,
    pub http: String,
    pub stderr: mpsc::Receiver<String>,
    /// The log lines up to and including the one with the addresses.
    pub startup_log: Vec<String>,
}

/// `kvatlas serve` on ephemeral loopback ports with `args`, no config file from the
/// environment, stdout and stderr piped (not started).
pub fn serve_command(args: &[&str]) -> Command {
    let mut command = Command::new(BIN);
    command
        .arg("serve")
        .args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .args(args)
        .env_remove("KVATLAS_CONFIG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// `kvatlas serve` with `args` that must not start: its exit status and everything it logged
/// (killed, and the test failed, if it still runs after 20 s).
pub fn refused_start(args: &[&str]) -> (std::process::ExitStatus, String) {
    let mut child = serve_command(args)
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("kvatlas serve runs");
    // Its log is read on a thread: a pipe left unread could block it.
    let mut stderr = child.stderr.take().expect("stderr");
    let reader = std::thread::spawn(move || {
        let mut log = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut log);
        log
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().expect("waits") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kvatlas serve {args:?} still runs after 20 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, reader.join().expect("the log"))
}

impl Served {
    pub fn start(args: &[&str]) -> Self {
        Self::start_with_env(args, &[])
    }

    /// As [`Served::start`], with these environment variables.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut child = serve_command(args)
            .envs(env.iter().copied())
            .spawn()
            .expect("kvatlas serve starts");
        let (tx, stderr) = mpsc::channel();
        let pipe = child.stderr.take().expect("stderr");
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut startup_log = Vec::new();
        let line = loop {
            let line = stderr
                .recv_timeout(WAIT)
                .expect("the server logs its addresses");
            startup_log.push(line.clone());
            if line.contains("kvatlas serving") {
                break line;
            }
        };
        let after = |marker: &str| {
            let rest = &line[line.find(marker).expect("marker") + marker.len()..];
            rest.split([',', ' ']).next().expect("address").to_owned()
        };
        Self {
            grpc: format!("http://{}", after("gRPC on ")),
            http: after("HTTP on "),
            child,
            stderr,
            startup_log,
        }
    }

    /// SIGTERM, then the exit status and stdout.
    pub fn terminate(mut self) -> (std::process::ExitStatus, String) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
        let mut stdout = Vec::new();
        if let Some(mut pipe) = self.child.stdout.take() {
            std::io::Read::read_to_end(&mut pipe, &mut stdout).expect("stdout");
        }
        let status = self.child.wait().expect("exits");
        (status, String::from_utf8_lossy(&stdout).into_owned())
    }
}

impl Drop for Served {
    /// A server a test did not stop (it returned without `terminate`, or panicked) is killed:
    /// it outlived its test before, for good.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

impl Served {
    /// SIGKILL: the process dies on the spot (no graceful shutdown, no final snapshot).
    pub fn kill_9(mut self) {
        self.child.kill().expect("SIGKILL");
        let _ = self.child.wait();
    }

    /// The memberships the server logged it restored from its data directory at start.
    pub fn restored_memberships(&self) -> u64 {
        let line = self
            .startup_log
            .iter()
            .find(|l| l.contains("restored the data directory's snapshot"))
            .unwrap_or_else(|| panic!("no restore logged: {:?}", self.startup_log));
        line.split("memberships=")
            .nth(1)
            .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|digits| digits.parse().ok())
            .unwrap_or_else(|| panic!("no memberships in {line}"))
    }

    /// The log lines received so far.
    pub fn log_lines(&self) -> Vec<String> {
        self.stderr.try_iter().collect()
    }
}

/// Sends `messages` on one `PublishEvents` stream to the server at `grpc` and waits for its
/// answer.
pub fn publish(grpc: &str, messages: Vec<kvatlas_proto::v1::PublishEventsRequest>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let mut client = kvatlas_proto::v1::indexer_client::IndexerClient::connect(grpc.to_owned())
            .await
            .expect("connects");
        client
            .publish_events(tokio_stream::iter(messages))
            .await
            .expect("published");
    });
}
