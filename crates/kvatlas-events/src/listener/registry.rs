//! The registry a server drives: [`Listeners`] starts, releases, stops and lists listeners
//! sharing one ZMQ context, one sink and one set of poller threads.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::{
    Listener, ListenerConfig, ListenerError, ListenerId, ListenerState, ListenerThreads,
    MutationSink, Resume,
};

/// A registry of listeners sharing one ZMQ context, one sink and one set of poller threads
/// ([`ListenerThreads`]): what a server drives.
///
/// Dropping it stops every listener.
pub struct Listeners {
    context: zmq::Context,
    sink: Arc<dyn MutationSink>,
    threads: ListenerThreads,
    next_id: AtomicU64,
    listeners: Mutex<BTreeMap<ListenerId, Listener>>,
}

impl fmt::Debug for Listeners {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listeners")
            .field("listeners", &self.listeners.lock().len())
            .finish_non_exhaustive()
    }
}

impl Listeners {
    /// An empty registry whose listeners hand their mutations to `sink`, on one poller thread
    /// of its own.
    ///
    /// # Errors
    /// [`ListenerError::Spawn`] if the thread cannot start.
    pub fn new(sink: Arc<dyn MutationSink>) -> Result<Self, ListenerError> {
        Self::with_context(zmq::Context::new(), sink)
    }

    /// An empty registry using an existing ZMQ context, on one poller thread of its own.
    ///
    /// # Errors
    /// [`ListenerError::Spawn`] if the thread cannot start.
    pub fn with_context(
        context: zmq::Context,
        sink: Arc<dyn MutationSink>,
    ) -> Result<Self, ListenerError> {
        let threads = ListenerThreads::new(1, "kvatlas-listen")?;
        Ok(Self::with_threads(context, sink, threads))
    }

    /// An empty registry whose listeners run on `threads` (shared with other registries: a
    /// server's indexes share one set).
    pub fn with_threads(
        context: zmq::Context,
        sink: Arc<dyn MutationSink>,
        threads: ListenerThreads,
    ) -> Self {
        Self {
            context,
            sink,
            threads,
            next_id: AtomicU64::new(1),
            listeners: Mutex::new(BTreeMap::new()),
        }
    }

    /// Starts a listener for `config`'s source.
    ///
    /// # Errors
    /// [`ListenerError::DuplicateSource`] if a listener already serves that worker rank, and
    /// the errors of [`Listener::start`] (bad endpoints among them).
    pub fn start(&self, config: ListenerConfig) -> Result<ListenerId, ListenerError> {
        let mut listeners = self.listeners.lock();
        let (worker_id, dp_rank) = (config.source.worker_id, config.source.dp_rank);
        if let Some(existing) = listeners
            .values()
            .find(|l| l.source().worker_id == worker_id && l.source().dp_rank == dp_rank)
        {
            return Err(ListenerError::DuplicateSource {
                worker_id,
                dp_rank,
                existing: existing.id(),
            });
        }
        let id = ListenerId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let listener = Listener::start_on(
            &self.context,
            &self.threads,
            id,
            config,
            Arc::clone(&self.sink),
        )?;
        listeners.insert(id, listener);
        Ok(id)
    }

    /// Stops listener `id`, waits for its thread, and returns its final state.
    ///
    /// # Errors
    /// [`ListenerError::UnknownListener`].
    pub fn stop(&self, id: ListenerId) -> Result<ListenerState, ListenerError> {
        // Joined outside the registry lock.
        let listener = self
            .listeners
            .lock()
            .remove(&id)
            .ok_or(ListenerError::UnknownListener(id))?;
        Ok(listener.stop())
    }

    /// Releases held listener `id` (see [`Listener::release`]).
    ///
    /// # Errors
    /// [`ListenerError::UnknownListener`].
    pub fn release(&self, id: ListenerId, resume: Option<Resume>) -> Result<(), ListenerError> {
        self.listeners
            .lock()
            .get(&id)
            .map(|listener| listener.release(resume))
            .ok_or(ListenerError::UnknownListener(id))
    }

    /// The state of listener `id`.
    ///
    /// # Errors
    /// [`ListenerError::UnknownListener`].
    pub fn state(&self, id: ListenerId) -> Result<ListenerState, ListenerError> {
        self.listeners
            .lock()
            .get(&id)
            .map(Listener::state)
            .ok_or(ListenerError::UnknownListener(id))
    }

    /// The states of every listener, by id.
    pub fn list(&self) -> Vec<ListenerState> {
        self.listeners
            .lock()
            .values()
            .map(Listener::state)
            .collect()
    }

    /// Stops every listener; returns their final states.
    pub fn stop_all(&self) -> Vec<ListenerState> {
        let listeners = std::mem::take(&mut *self.listeners.lock());
        listeners.into_values().map(Listener::stop).collect()
    }
}

impl Drop for Listeners {
    fn drop(&mut self) {
        self.stop_all();
    }
}
