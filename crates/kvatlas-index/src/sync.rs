//! The synchronization primitives of the concurrent fronts, swapped for loom's under
//! `--cfg loom` so that `tests/loom.rs` can model-check every interleaving (as tokio does).
//!
//! The facade exposes `parking_lot`'s guard-returning API; under loom it wraps loom's `std`-style
//! locks (a poisoned loom lock means a panicking model thread, which fails the model anyway).

#[cfg(not(loom))]
pub(crate) use parking_lot::{Mutex, RwLock};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::AtomicUsize;

#[cfg(loom)]
pub(crate) use loom::sync::atomic::AtomicUsize;

#[cfg(loom)]
mod loom_locks {
    /// `parking_lot`-style wrapper over loom's mutex.
    #[derive(Debug)]
    pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

    impl<T> Mutex<T> {
        pub(crate) fn new(value: T) -> Self {
            Self(loom::sync::Mutex::new(value))
        }

        pub(crate) fn lock(&self) -> loom::sync::MutexGuard<'_, T> {
            self.0
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
        }
    }

    /// `parking_lot`-style wrapper over loom's reader-writer lock.
    #[derive(Debug)]
    pub(crate) struct RwLock<T>(loom::sync::RwLock<T>);

    impl<T> RwLock<T> {
        pub(crate) fn new(value: T) -> Self {
            Self(loom::sync::RwLock::new(value))
        }

        pub(crate) fn read(&self) -> loom::sync::RwLockReadGuard<'_, T> {
            self.0
                .read()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
        }

        pub(crate) fn write(&self) -> loom::sync::RwLockWriteGuard<'_, T> {
            self.0
                .write()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
        }

        pub(crate) fn try_read(&self) -> Option<loom::sync::RwLockReadGuard<'_, T>> {
            match self.0.try_read() {
                Ok(guard) => Some(guard),
                Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            }
        }

        pub(crate) fn try_write(&self) -> Option<loom::sync::RwLockWriteGuard<'_, T>> {
            match self.0.try_write() {
                Ok(guard) => Some(guard),
                Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            }
        }
    }
}

#[cfg(loom)]
pub(crate) use loom_locks::{Mutex, RwLock};
