//! Re-reading the token file and the TLS certificate and key while the server runs: on SIGHUP,
//! and every [`RELOAD_CHECK`] (a Kubernetes secret or a cert-manager certificate is rewritten
//! in place, with no signal). A file that reads as before changes nothing; one that changed and
//! is valid is in force from the next request or handshake on; one that changed and is not is
//! refused — the server goes on with what it had, logs why (once per distinct problem) and
//! counts it (`kvatlas_reloads_total{file,outcome}`). Requests, streams and connections already
//! admitted keep the token and certificate they were admitted with.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::state::State;
use crate::tls::ServerIdentity;

/// How often the files are checked without a signal.
pub(crate) const RELOAD_CHECK: Duration = Duration::from_secs(10);

/// What one check of a file found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReloadOutcome {
    /// It reads as the one in force.
    Unchanged,
    /// It changed and is in force now.
    Applied,
    /// It changed and was refused (why); the one in force stays.
    Refused(String),
}

/// What a check of the token file and the TLS certificate found (`None`: not configured).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Reloaded {
    /// The token file (`--auth-tokens`).
    pub tokens: Option<ReloadOutcome>,
    /// The TLS certificate and key (`--tls-cert`, `--tls-key`).
    pub tls: Option<ReloadOutcome>,
}

/// The files a check reads, and what it last said about each.
#[derive(Debug)]
pub(crate) struct Reloader {
    state: Arc<State>,
    tls: Option<Arc<ServerIdentity>>,
    /// The last refusal logged for the tokens and the certificate (a file that stays bad is
    /// not logged again at every check).
    said: parking_lot::Mutex<[Option<String>; 2]>,
}

impl Reloader {
    /// A reloader of `state`'s token file and of `tls`.
    pub(crate) fn new(state: Arc<State>, tls: Option<Arc<ServerIdentity>>) -> Self {
        Self {
            state,
            tls,
            said: parking_lot::Mutex::new([None, None]),
        }
    }

    /// Whether there is anything to reload.
    fn configured(&self) -> bool {
        self.state.tokens.is_some() || self.tls.is_some()
    }

    /// Reads the files once (blocking file reads: call it off the runtime's workers).
    pub(crate) fn check(&self) -> Reloaded {
        let tokens = self.state.tokens.as_ref().map(|file| {
            let outcome = match file.reload() {
                Ok(None) => ReloadOutcome::Unchanged,
                Ok(Some(count)) => {
                    tracing::info!(
                        file = %file.path().display(),
                        tokens = count,
                        "reloaded the token file: {count} token(s) in force"
                    );
                    ReloadOutcome::Applied
                }
                Err(error) => ReloadOutcome::Refused(error.to_string()),
            };
            self.record(0, "tokens", &outcome);
            outcome
        });
        let tls = self.tls.as_ref().map(|identity| {
            let outcome = match identity.reload() {
                Ok(false) => ReloadOutcome::Unchanged,
                Ok(true) => {
                    tracing::info!(
                        cert = %identity.files().cert.display(),
                        "reloaded the TLS certificate and key: new connections get them"
                    );
                    ReloadOutcome::Applied
                }
                Err(error) => ReloadOutcome::Refused(error),
            };
            self.record(1, "tls", &outcome);
            outcome
        });
        Reloaded { tokens, tls }
    }

    /// Counts `outcome` of file `which` and logs a refusal unless it was the last one logged.
    fn record(&self, which: usize, file: &'static str, outcome: &ReloadOutcome) {
        let mut said = self.said.lock();
        match outcome {
            ReloadOutcome::Unchanged => said[which] = None,
            ReloadOutcome::Applied => {
                said[which] = None;
                self.state.metrics.reload(file, true);
            }
            ReloadOutcome::Refused(why) => {
                self.state.metrics.reload(file, false);
                if said[which].as_deref() != Some(why.as_str()) {
                    tracing::warn!("not reloaded, the server goes on with what it has: {why}");
                    said[which] = Some(why.clone());
                }
            }
        }
    }

    /// Checks the files on SIGHUP and every [`RELOAD_CHECK`] until `stop`.
    pub(crate) async fn watch(self: Arc<Self>, stop: CancellationToken) {
        if !self.configured() {
            return;
        }
        #[cfg(unix)]
        let mut hangup =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        loop {
            #[cfg(unix)]
            let signalled = async {
                match hangup.as_mut() {
                    Some(signal) => signal.recv().await,
                    None => std::future::pending().await,
                }
            };
            #[cfg(not(unix))]
            let signalled = std::future::pending::<Option<()>>();
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(RELOAD_CHECK) => {}
                Some(()) = signalled => {
                    tracing::info!("SIGHUP: reading the token file and the TLS certificate again");
                }
            }
            let reloader = Arc::clone(&self);
            if tokio::task::spawn_blocking(move || reloader.check())
                .await
                .is_err()
            {
                tracing::warn!("a check of the token file and the TLS certificate failed");
            }
        }
    }
}
