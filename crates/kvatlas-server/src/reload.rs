//! Re-reading the token file and the TLS certificate and key while the server runs: on SIGHUP,
//! and every `--reload-check-secs` (a Kubernetes secret or a cert-manager certificate is
//! rewritten with no signal). A file that reads as before changes nothing; one that changed is
//! read again [`SETTLE`] later, and taken only if it reads the same (a file being written in
//! place, or a certificate written before its key, waits for the next check); one that changed
//! and is valid is in force from the next request or handshake on; one that changed and is not
//! is refused — the server goes on with what it had, logs why (once per distinct problem) and
//! counts it (`kvatlas_reloads_total{file,outcome}`). Requests, streams and connections already
//! admitted keep the token and certificate they were admitted with.
//!
//! SIGHUP never ends the server (its default action would): it is taken from the server's
//! start on, and only logged when there is nothing to read again.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::state::State;
use crate::tls::ServerIdentity;

/// How long after a changed file's read it is read again, to tell a file being written from
/// one that was.
pub(crate) const SETTLE: Duration = Duration::from_millis(100);

/// Whether a file that read as `first` reads the same [`SETTLE`] later (`read` reads it again;
/// blocking).
///
/// # Errors
/// `read`'s.
pub(crate) fn settled<T: PartialEq, E>(
    first: &T,
    read: impl FnOnce() -> Result<T, E>,
) -> Result<bool, E> {
    std::thread::sleep(SETTLE);
    Ok(read()? == *first)
}

/// What one check of a file found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReloadOutcome {
    /// It reads as the one in force (or is still being written: the next check takes it).
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

    /// [`Reloader::check`] on a blocking thread; a check that failed (panicked) is reported as
    /// a refusal of every file it would have read.
    pub(crate) async fn check_off_the_runtime(self: &Arc<Self>) -> Reloaded {
        let reloader = Arc::clone(self);
        match tokio::task::spawn_blocking(move || reloader.check()).await {
            Ok(reloaded) => reloaded,
            Err(error) => {
                let why = format!("the check failed: {error}");
                tracing::warn!("reading the token file and the TLS certificate again: {why}");
                let refused = || ReloadOutcome::Refused(why.clone());
                Reloaded {
                    tokens: self.state.tokens.as_ref().map(|_| refused()),
                    tls: self.tls.as_ref().map(|_| refused()),
                }
            }
        }
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

    /// Checks the files on SIGHUP and every `every` (`None`: on SIGHUP only) until `stop`.
    /// SIGHUP is taken from this call on, before the future first runs (a signal in between
    /// would end the process).
    pub(crate) fn watch(
        self: Arc<Self>,
        every: Option<Duration>,
        stop: CancellationToken,
    ) -> impl std::future::Future<Output = ()> + Send {
        #[cfg(unix)]
        let mut hangup =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        #[cfg(not(unix))]
        let mut hangup: Option<()> = None;
        async move {
            let every = every.filter(|_| self.configured());
            loop {
                let signalled = async {
                    #[cfg(unix)]
                    if let Some(signal) = hangup.as_mut() {
                        return signal.recv().await;
                    }
                    let _ = &mut hangup;
                    std::future::pending().await
                };
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = sleep_or_never(every) => {}
                    Some(()) = signalled => {
                        if !self.configured() {
                            tracing::info!(
                                "SIGHUP: nothing to read again (no --auth-tokens, no --tls-cert)"
                            );
                            continue;
                        }
                        tracing::info!(
                            "SIGHUP: reading the token file and the TLS certificate again"
                        );
                    }
                }
                self.check_off_the_runtime().await;
            }
        }
    }
}

async fn sleep_or_never(every: Option<Duration>) {
    match every {
        Some(every) => tokio::time::sleep(every).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_settled_when_it_reads_the_same_twice() {
        assert_eq!(settled(&"a", || Ok::<_, ()>("a")), Ok(true));
        assert_eq!(
            settled(&"a", || Ok::<_, ()>("ab")),
            Ok(false),
            "still being written"
        );
        assert_eq!(settled(&"a", || Err::<&str, _>("gone")), Err("gone"));
    }
}
