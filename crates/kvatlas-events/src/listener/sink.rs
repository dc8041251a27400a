//! Where a listener hands its mutations: the [`MutationSink`] trait and its implementations.

use std::sync::Arc;

use kvatlas_index::{Checkpoint, EnqueueError, SharedKvIndex, ThreadPool, Unit};

/// Why a [`MutationSink`] did not take a unit; the unit is handed back.
#[derive(Debug)]
pub enum SinkError {
    /// The sink is full right now (the index is not keeping up): try again later.
    Full(Unit),
    /// The sink is gone for good (its writer threads stopped).
    Closed(Unit),
}

/// Where a listener hands its mutations: a bounded, per-worker-ordered queue in front of an
/// index.
///
/// Contract: units of one worker pushed by one thread are applied in push order, each whole
/// ([`ThreadPool`]'s sticky lanes guarantee it). `try_push` never blocks; the listener waits
/// and retries on [`SinkError::Full`], which is how backpressure reaches the socket.
pub trait MutationSink: Send + Sync {
    /// Hands over one unit (a batch's mutations and its checkpoint) if there is room.
    ///
    /// # Errors
    /// [`SinkError::Full`] to be retried later, [`SinkError::Closed`] for good.
    fn try_push(&self, unit: Unit) -> Result<(), SinkError>;
}

impl<I: SharedKvIndex + 'static> MutationSink for ThreadPool<I> {
    fn try_push(&self, unit: Unit) -> Result<(), SinkError> {
        self.try_enqueue_unit(unit).map_err(|error| match error {
            EnqueueError::Full(u) => SinkError::Full(u),
            EnqueueError::Stopped(u) => SinkError::Closed(u),
        })
    }
}

impl<S: MutationSink + ?Sized> MutationSink for Arc<S> {
    fn try_push(&self, unit: Unit) -> Result<(), SinkError> {
        (**self).try_push(unit)
    }
}

/// A sink that applies each unit inline, on the listener's poller thread, to a shared index
/// (never full). Simple, and the poller thread pays for the index writes (delaying the other
/// listeners it serves).
#[derive(Debug)]
pub struct ApplyInline<I>(pub Arc<I>);

impl<I: SharedKvIndex> MutationSink for ApplyInline<I> {
    fn try_push(&self, unit: Unit) -> Result<(), SinkError> {
        let mut mutations = unit.mutations;
        let mut checkpoints: Vec<Checkpoint> = unit.checkpoint.into_iter().collect();
        self.0.apply_checkpointed(&mut mutations, &mut checkpoints);
        Ok(())
    }
}
