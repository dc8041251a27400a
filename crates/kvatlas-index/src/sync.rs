//! The synchronization primitives of the concurrent fronts, swapped for loom's under
//! `--cfg loom` so that `tests/loom.rs` can model-check every interleaving (as tokio does).
//!
//! The facade exposes `parking_lot`'s guard-returning API; under loom it wraps loom's `std`-style
//! locks (a poisoned loom lock means a panicking model thread, which fails the model anyway).

#[cfg(not(loom))]
pub(crate) use parking_lot::{Condvar, Mutex, MutexGuard, RwLock};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicUsize};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicUsize};

/// Waits on `condvar` with `guard` held, for at most `timeout` (under loom without a timeout: a
/// lost wakeup then shows as a deadlock of the model).
#[cfg(not(loom))]
pub(crate) fn wait_for<'a, T>(
    condvar: &Condvar,
    mut guard: MutexGuard<'a, T>,
    timeout: std::time::Duration,
) -> MutexGuard<'a, T> {
    condvar.wait_for(&mut guard, timeout);
    guard
}

/// Waits on `condvar` with `guard` held (loom: no timeout, see the other form).
#[cfg(loom)]
pub(crate) fn wait_for<'a, T>(
    condvar: &Condvar,
    guard: MutexGuard<'a, T>,
    _timeout: std::time::Duration,
) -> MutexGuard<'a, T> {
    condvar
        .0
        .wait(guard)
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(loom)]
mod loom_locks {
    /// loom's mutex guard.
    pub(crate) type MutexGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

    /// `parking_lot`-style wrapper over loom's condition variable (waits go through
    /// [`super::wait_for`]).
    #[derive(Debug)]
    pub(crate) struct Condvar(pub(crate) loom::sync::Condvar);

    impl Condvar {
        pub(crate) fn new() -> Self {
            Self(loom::sync::Condvar::new())
        }

        pub(crate) fn notify_all(&self) {
            self.0.notify_all();
        }
    }

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
pub(crate) use loom_locks::{Condvar, Mutex, MutexGuard, RwLock};
