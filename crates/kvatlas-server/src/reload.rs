//! Re-reading the token file and the TLS certificate and key while the server runs: on SIGHUP,
//! and every `--reload-check-secs` (a Kubernetes secret or a cert-manager certificate is
//! rewritten with no signal). A file that reads as before changes nothing; one that changed is
//! read again every [`SETTLE`] until two reads agree (a file being written in place, or a key
//! written shortly after its certificate, is taken once written; one still changing after
//! [`SETTLE_READS`] reads waits for the next check); one that changed and is valid is in force
//! from the next request or handshake on; one that changed and is not is refused — the server
//! goes on with what it had, logs why (once per distinct problem) and counts it (`kvatlas_reloads_total{file,outcome}`). Requests, streams and connections already
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

/// Reads of a changed file, [`SETTLE`] apart, before it is given up as still being written.
pub(crate) const SETTLE_READS: usize = 10;

/// What reading a file again found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Reread<T> {
    /// It reads as the one loaded.
    Same,
    /// It read differently at each of [`SETTLE_READS`] reads.
    Unsettled,
    /// It changed and read the same twice in a row: this.
    Changed(T),
}

/// Reads a file with `read` (blocking): [`Reread::Same`] when its `digest` is `loaded`;
/// otherwise it is read again every [`SETTLE`] until two reads in a row agree.
///
/// # Errors
/// `read`'s.
pub(crate) fn reread<T: PartialEq, E>(
    loaded: &[u8; 32],
    digest: impl Fn(&T) -> [u8; 32],
    mut read: impl FnMut() -> Result<T, E>,
) -> Result<Reread<T>, E> {
    let mut last = read()?;
    if digest(&last) == *loaded {
        return Ok(Reread::Same);
    }
    for _ in 1..SETTLE_READS {
        std::thread::sleep(SETTLE);
        let again = read()?;
        if again == last {
            return Ok(if digest(&again) == *loaded {
                Reread::Same
            } else {
                Reread::Changed(again)
            });
        }
        last = again;
    }
    Ok(Reread::Unsettled)
}

/// Reads a file again with `read` ([`reread`]) under `loaded` (the digest of what is in force,
/// held from the read to the swap, so that two reloads cannot put an older file back in force);
/// a changed one goes to `apply`, and its digest is recorded once applied.
///
/// # Errors
/// `read`'s or `apply`'s; what is in force and `loaded` do not change.
pub(crate) fn reload_file<T: PartialEq, R, E>(
    loaded: &parking_lot::Mutex<[u8; 32]>,
    digest: impl Fn(&T) -> [u8; 32],
    read: impl FnMut() -> Result<T, E>,
    apply: impl FnOnce(&T) -> Result<R, E>,
) -> Result<Reread<R>, E> {
    let mut loaded = loaded.lock();
    let content = match reread(&loaded, &digest, read)? {
        Reread::Changed(content) => content,
        Reread::Same => return Ok(Reread::Same),
        Reread::Unsettled => return Ok(Reread::Unsettled),
    };
    let applied = apply(&content)?;
    *loaded = digest(&content);
    Ok(Reread::Changed(applied))
}

/// What a file's reload found; `applied` says what a change put in force.
fn outcome_of<R, E: std::fmt::Display>(
    reloaded: Result<Reread<R>, E>,
    applied: impl FnOnce(R),
) -> ReloadOutcome {
    match reloaded {
        Ok(Reread::Same) => ReloadOutcome::Unchanged,
        Ok(Reread::Unsettled) => ReloadOutcome::Unsettled,
        Ok(Reread::Changed(what)) => {
            applied(what);
            ReloadOutcome::Applied
        }
        Err(error) => ReloadOutcome::Refused(error.to_string()),
    }
}

/// What one check of a file found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReloadOutcome {
    /// It reads as the one in force.
    Unchanged,
    /// It changed, and read differently at each read for about a second (still being
    /// written): the one in force stays, the next check or SIGHUP reads it again.
    Unsettled,
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
        if state.tokens.is_some() {
            state.metrics.declare_reloads("tokens");
        }
        if tls.is_some() {
            state.metrics.declare_reloads("tls");
        }
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
            let outcome = outcome_of(file.reload(), |count| {
                tracing::info!(
                    file = %file.path().display(),
                    tokens = count,
                    "reloaded the token file: {count} token(s) in force"
                );
            });
            self.record(0, "tokens", &outcome);
            outcome
        });
        let tls = self.tls.as_ref().map(|identity| {
            let outcome = outcome_of(identity.reload(), |()| {
                tracing::info!(
                    cert = %identity.files().cert.display(),
                    "reloaded the TLS certificate and key: new connections get them"
                );
            });
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
            ReloadOutcome::Unsettled => tracing::info!(
                "the {file} file(s) changed at every read for a second (still being written?): \
                 the next check or SIGHUP reads them again"
            ),
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

    /// Checks the files on `hangup` and every `every` (`None`: on SIGHUP only) until `stop`.
    pub(crate) async fn watch(
        self: Arc<Self>,
        mut hangup: Hangup,
        every: Option<Duration>,
        stop: CancellationToken,
    ) {
        let every = every.filter(|_| self.configured());
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = sleep_or_never(every) => {}
                Some(()) = hangup.received() => {
                    if !self.configured() {
                        tracing::info!(
                            "SIGHUP: nothing to read again (no --auth-tokens, no --tls-cert)"
                        );
                        continue;
                    }
                    tracing::info!("SIGHUP: reading the token file and the TLS certificate again");
                }
            }
            self.check_off_the_runtime().await;
        }
    }
}

/// SIGHUP, taken from [`Hangup::take`] on: its default action, ending the process, no longer
/// applies (a rotation tool that signals a server still starting does not kill it; a signal
/// before the server watches is dropped, and the periodic check finds what changed).
#[derive(Debug)]
pub(crate) struct Hangup {
    #[cfg(unix)]
    signal: Option<tokio::signal::unix::Signal>,
}

impl Hangup {
    /// Takes SIGHUP from now on (within a tokio runtime).
    pub(crate) fn take() -> Self {
        Self {
            #[cfg(unix)]
            signal: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok(),
        }
    }

    /// The next SIGHUP (`None` once no more can come; never without the signal).
    async fn received(&mut self) -> Option<()> {
        #[cfg(unix)]
        if let Some(signal) = self.signal.as_mut() {
            return signal.recv().await;
        }
        std::future::pending().await
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
    fn a_changed_file_is_taken_once_it_reads_the_same_twice() {
        let digest = |text: &&str| [text.len() as u8; 32];
        let reads = |texts: &'static [&'static str]| {
            let mut texts = texts.iter();
            move || texts.next().copied().ok_or("no more reads")
        };
        assert_eq!(reread(&[1; 32], digest, reads(&["a"])), Ok(Reread::Same));
        assert_eq!(
            reread(&[1; 32], digest, reads(&["ab", "abc", "abc"])),
            Ok(Reread::Changed("abc")),
            "written while read"
        );
        assert_eq!(
            reread(&[1; 32], digest, reads(&["ab", "b", "b"])),
            Ok(Reread::Same),
            "back to the one loaded"
        );
        let growing: &'static [&'static str] = &[
            "a",
            "aa",
            "aaa",
            "aaaa",
            "aaaaa",
            "aaaaaa",
            "aaaaaaa",
            "aaaaaaaa",
            "aaaaaaaaa",
            "aaaaaaaaaa",
        ];
        assert_eq!(
            reread(&[0; 32], digest, reads(growing)),
            Ok(Reread::Unsettled)
        );
        assert_eq!(
            reread(&[0; 32], digest, reads(&["a"])),
            Err("no more reads")
        );
    }
}
