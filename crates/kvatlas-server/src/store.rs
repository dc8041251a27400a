//! The data directory (`--data-dir`): snapshot files a restarted server comes back from.
//!
//! Files are `snapshot-<Unix µs, 20 digits>.kvs` in the native format (`snapshot`), the number
//! kept above every existing one's should the wall clock step back. A write goes
//! to a hidden temporary file in the same directory, is fsynced, renamed into place and the
//! directory fsynced: a crash at any point leaves the previous snapshots intact and at most a
//! temporary file, which the next start removes. The newest [`KEEP`] snapshots are kept.
//!
//! Loading tries the snapshots newest first; one that cannot be read (truncated, altered) is
//! logged with the reason and renamed to `*.kvs.rejected` — moved aside, never deleted, never
//! retried — and the next older one is tried; with none left the server starts empty. One
//! written by a newer kvatlas (its format version above this build's: a rollback) is sound: it
//! is logged and skipped but left in place, and pruning keeps it, so that rolling forward again
//! can read it (renamed aside, every rollback lost the newer build's snapshots for good and
//! left three full-size `.rejected` files). A file that reads but does not fit the server's settings (an index whose block size
//! the server's own configuration fixes otherwise, more indexes than its limit) is set aside the
//! same way by the server ([`DataDir::set_aside`]). A bad file never stops the server from
//! starting.
//!
//! One server per directory: opening it takes an exclusive lock on its `.lock` file, held
//! while the [`DataDir`] (or a clone) lives and released when the process ends, however it
//! ends. A second server on the same directory would remove the first's snapshot under way as
//! a crash's leftover, prune its snapshots and write its own among them; it is refused at start.
//!
//! The files are the server's user's alone: a directory it creates is `0700`, and its snapshot
//! and lock files are `0600` (they hold every tenant's block hashes, hashes of prompt prefixes,
//! and the registrations; with the umask's `0644` any user of the host could read them, which
//! over the API only a token allowed every tenant can).

use std::fs::{self, File};
use std::io::{BufReader, BufWriter};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::snapshot::{self, IndexImage, SnapshotError};

/// Snapshot files kept in the data directory.
pub const KEEP: usize = 3;

const PREFIX: &str = "snapshot-";
const SUFFIX: &str = ".kvs";
const TEMP_PREFIX: &str = ".tmp-snapshot-";
/// The file a server locks while it uses the directory.
const LOCK_FILE: &str = ".lock";

/// A data directory, locked for this process while the value or a clone lives.
#[derive(Debug, Clone)]
pub struct DataDir {
    path: PathBuf,
    /// The lock file, locked exclusively (an advisory `flock`, released when the last clone
    /// drops or the process ends).
    _lock: Arc<File>,
}

/// What a write produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The snapshot file.
    pub path: PathBuf,
    /// Its size.
    pub bytes: u64,
    /// The memberships it holds.
    pub memberships: u64,
}

/// What loading found.
#[derive(Debug)]
pub struct Loaded {
    /// The snapshot used, with its creation time and indexes.
    pub snapshot: Option<(PathBuf, i64, Vec<IndexImage>)>,
    /// Files refused (moved aside), with the reason.
    pub rejected: Vec<(PathBuf, SnapshotError)>,
}

impl DataDir {
    /// Opens (creating it if needed) and locks a data directory, removing temporary files a
    /// crash left.
    ///
    /// # Errors
    /// The I/O error creating, locking or listing it; [`std::io::ErrorKind::ResourceBusy`] if
    /// another server (or another `DataDir` of this process) holds it.
    pub fn open(path: impl Into<PathBuf>) -> std::io::Result<Self> {
        let path = path.into();
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&path)?;
        let lock_path = path.join(LOCK_FILE);
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&lock_path)?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::ResourceBusy,
                    format!(
                        "another kvatlas server uses it (it holds the lock on {}); give each \
                         server its own --data-dir",
                        lock_path.display()
                    ),
                ));
            }
            Err(fs::TryLockError::Error(error)) => return Err(error),
        }
        for entry in fs::read_dir(&path)? {
            let entry = entry?;
            if entry
                .file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(TEMP_PREFIX))
            {
                let _ = fs::remove_file(entry.path());
            }
        }
        Ok(Self {
            path,
            _lock: Arc::new(lock),
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The snapshot files, newest (highest number) first: `snapshot-<digits>.kvs` only. Another
    /// name (`snapshot-backup.kvs`) is not a snapshot of this directory's: it is left alone, and
    /// a shorter number (`snapshot-1.kvs`, placed by hand) is ordered by its value (compared as
    /// text, it sorted above every snapshot written since and was restored at every start).
    pub fn snapshots(&self) -> std::io::Result<Vec<PathBuf>> {
        let mut files: Vec<(i64, PathBuf)> = fs::read_dir(&self.path)?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter_map(|p| number_of(&p).map(|n| (n, p)))
            .collect();
        // Newest first; equal numbers (`snapshot-01.kvs` beside `snapshot-1.kvs`) by name.
        files.sort_by(|a, b| b.cmp(a));
        Ok(files.into_iter().map(|(_, p)| p).collect())
    }

    /// Writes `images` as a new snapshot (see the module docs), then prunes old ones. The images
    /// are taken from the iterator one at a time and dropped once written, so a lazy iterator
    /// holds one index's image in memory, never the whole state.
    ///
    /// # Errors
    /// The I/O or encoding error; the previous snapshots are untouched.
    pub fn write(
        &self,
        images: impl IntoIterator<Item = IndexImage>,
        created: i64,
    ) -> Result<Written, SnapshotError> {
        // Names order the snapshots (newest first on load). A wall clock that stepped back must
        // not make this one sort before an older one: its number is above every existing one.
        let newest = self.snapshots()?.first().and_then(|p| number_of(p));
        let number = created
            .max(0)
            .max(newest.map_or(0, |n| n.saturating_add(1)));
        let name = format!("{PREFIX}{number:020}{SUFFIX}");
        let final_path = self.path.join(&name);
        let temp = self.path.join(format!("{TEMP_PREFIX}{name}"));
        let mut memberships = 0;
        let result = (|| {
            let file = File::options()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&temp)?;
            let mut writer =
                snapshot::Writer::new(BufWriter::with_capacity(1 << 20, file), created)?;
            for image in images {
                memberships += image.memberships();
                writer.index(&image)?;
            }
            let file = writer
                .finish()?
                .into_inner()
                .map_err(|e| SnapshotError::Io(e.into_error()))?;
            file.sync_all()?;
            let bytes = file.metadata()?.len();
            drop(file);
            fs::rename(&temp, &final_path)?;
            Ok::<_, SnapshotError>(bytes)
        })();
        let bytes = match result {
            Ok(bytes) => bytes,
            Err(error) => {
                let _ = fs::remove_file(&temp);
                return Err(error);
            }
        };
        // From here the snapshot is in place, whole and fsynced: it is written, whatever
        // follows (reported as failed, it was there all the same, and the older ones were not
        // pruned). The rename is durable once the directory is; if that sync fails, a crash
        // may still bring back the directory without it, and the older snapshots are then
        // what a restart finds: they are not pruned (pruned, a crash could leave neither).
        let written = Written {
            path: final_path,
            bytes,
            memberships,
        };
        if let Err(error) = sync_dir(&self.path) {
            tracing::warn!(
                dir = %self.path.display(),
                "syncing the data directory after a snapshot failed: {error}; the snapshot is \
                 in place but a crash may lose its name (the older snapshots are kept)"
            );
            return Ok(written);
        }
        match self.snapshots() {
            Ok(files) => {
                for old in files.into_iter().skip(KEEP) {
                    if !written_by_a_newer_build(&old) {
                        let _ = fs::remove_file(old);
                    }
                }
            }
            Err(error) => tracing::warn!(
                dir = %self.path.display(),
                "listing the data directory to prune old snapshots failed: {error}; they are \
                 pruned after the next snapshot"
            ),
        }
        Ok(written)
    }

    /// Loads the newest readable snapshot (see the module docs).
    ///
    /// # Errors
    /// The I/O error listing the directory, or opening or reading a snapshot file (permissions,
    /// a failing disk: the file may be sound, so it is not moved aside and the start fails with
    /// the file named). A file that reads but is bad is not an error: it is moved aside.
    pub fn load(&self) -> std::io::Result<Loaded> {
        let mut rejected = Vec::new();
        for path in self.snapshots()? {
            let read = File::open(&path)
                .map_err(SnapshotError::from)
                .and_then(|file| snapshot::read(BufReader::with_capacity(1 << 20, file)));
            match read {
                Ok((created, images)) => {
                    return Ok(Loaded {
                        snapshot: Some((path, created, images)),
                        rejected,
                    });
                }
                Err(SnapshotError::Io(error)) => {
                    return Err(std::io::Error::new(
                        error.kind(),
                        format!("reading the snapshot {}: {error}", path.display()),
                    ));
                }
                Err(newer @ SnapshotError::NewerVersion { .. }) => {
                    // Sound, for a newer build: left where it is (see the module docs).
                    rejected.push((path, newer));
                }
                Err(error) => {
                    // A file that cannot be renamed (a read-only directory) is skipped here
                    // (the next older one is tried) and stays for the operator.
                    if let Err(cannot) = set_aside(&path) {
                        tracing::warn!(
                            file = %path.display(),
                            "a refused snapshot could not be moved aside: {cannot}"
                        );
                    }
                    rejected.push((path, error));
                }
            }
        }
        Ok(Loaded {
            snapshot: None,
            rejected,
        })
    }

    /// Moves a snapshot that was read but cannot be used here (it does not fit this server's
    /// settings) aside as a refused file is, so that the next [`DataDir::load`] tries the next
    /// older one.
    ///
    /// # Errors
    /// If it cannot be renamed (a read-only directory): the caller must not load again, or it
    /// would find the same file for ever.
    pub fn set_aside(&self, path: &Path) -> std::io::Result<()> {
        set_aside(path)
    }
}

/// The number in a snapshot file's name (`snapshot-<number>.kvs`).
/// The number of a snapshot file's name, `snapshot-<ASCII digits>.kvs` (`None` for any other
/// name, a sign or a number beyond `i64` included).
fn number_of(path: &Path) -> Option<i64> {
    let digits = path
        .file_name()?
        .to_str()?
        .strip_prefix(PREFIX)?
        .strip_suffix(SUFFIX)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Whether the file at `path` is a snapshot of a format version above this build's (its
/// header says so; a file that cannot be read says nothing).
fn written_by_a_newer_build(path: &Path) -> bool {
    use std::io::Read as _;
    let mut header = [0u8; 10];
    File::open(path)
        .and_then(|mut file| file.read_exact(&mut header))
        .is_ok()
        && header[..8] == snapshot::MAGIC[..]
        && u16::from_le_bytes([header[8], header[9]]) > snapshot::FORMAT_VERSION
}

/// Renames `path` to `path.rejected` (kept for the operator, never retried).
fn set_aside(path: &Path) -> std::io::Result<()> {
    let mut aside = path.to_owned().into_os_string();
    aside.push(".rejected");
    fs::rename(path, aside)
}

/// Makes the directory's entries (a rename) durable.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(test)]
    if tests::FAIL_DIR_SYNC.get() {
        return Err(std::io::Error::other("a directory sync made to fail"));
    }
    File::open(dir).and_then(|dir| dir.sync_all())
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        /// Makes [`sync_dir`] fail on this thread.
        pub(super) static FAIL_DIR_SYNC: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// The older snapshots are not pruned after a snapshot whose rename may not be durable
    /// (its directory's sync failed): a crash could bring back the directory without the new
    /// one's name, and the older ones are then what a restart finds (they were deleted).
    #[test]
    fn older_snapshots_stay_when_the_directory_sync_fails() {
        let dir = DataDir::open(temp("dir-sync")).expect("dir");
        for created in 1..=KEEP as i64 {
            dir.write([image(2)], created).expect("write");
        }
        let oldest = dir.snapshots().expect("list")[KEEP - 1].clone();
        FAIL_DIR_SYNC.set(true);
        let written = dir.write([image(3)], 100);
        FAIL_DIR_SYNC.set(false);
        written.expect("written, the sync failure reported in the log");
        assert!(
            oldest.exists(),
            "pruned although the new name may not be durable"
        );
        assert_eq!(dir.snapshots().expect("list").len(), KEEP + 1);
        dir.write([image(4)], 200).expect("write");
        assert_eq!(
            dir.snapshots().expect("list").len(),
            KEEP,
            "pruned once synced"
        );
        let _ = fs::remove_dir_all(dir.path());
    }
    use crate::registry::IndexKey;
    use kvatlas_hash::{BlockSize, LocalBlockHash};
    use kvatlas_index::{
        ExternalBlockHash, Snapshot, SnapshotBlock, TierSet, Worker, WorkerSnapshot,
    };

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kvatlas-store-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    fn image(blocks: u64) -> IndexImage {
        IndexImage {
            key: IndexKey::new("m", ""),
            block_size: BlockSize::new(4).expect("4"),
            capacity: None,
            feeds: Vec::new(),
            marks: Default::default(),
            snapshot: Snapshot {
                workers: vec![WorkerSnapshot {
                    worker: Worker::new(1, 0),
                    blocks: (0..blocks)
                        .map(|i| SnapshotBlock {
                            external: ExternalBlockHash::new(i),
                            local: LocalBlockHash::new(i * 3),
                            parent: i.checked_sub(1).map(ExternalBlockHash::new),
                            tiers: TierSet::from_bits(1),
                        })
                        .collect(),
                }],
            },
        }
    }

    /// Snapshots are ordered by their number, and only `snapshot-<digits>.kvs` is one: a file
    /// placed by hand as `snapshot-1.kvs` is the oldest (as text it sorted above every snapshot
    /// written since, and was restored at every start), `snapshot-backup.kvs` is not listed.
    #[test]
    fn snapshots_are_ordered_by_number_and_other_names_left_alone() {
        let dir = DataDir::open(temp("names")).expect("dir");
        dir.write([image(3)], 1_000).expect("write");
        let old = dir.snapshots().expect("list")[0].clone();
        fs::copy(&old, dir.path().join("snapshot-1.kvs")).expect("copy");
        fs::copy(&old, dir.path().join("snapshot-backup.kvs")).expect("copy");
        fs::copy(&old, dir.path().join("snapshot-+7.kvs")).expect("copy");
        let newest = dir.write([image(5)], 2_000).expect("write");
        let files = dir.snapshots().expect("list");
        assert_eq!(files.len(), 3, "{files:?}");
        assert_eq!(files[0], newest.path);
        assert_eq!(files[2], dir.path().join("snapshot-1.kvs"));
        let (_, created, images) = dir.load().expect("load").snapshot.expect("one");
        assert_eq!((created, images[0].snapshot.blocks()), (2_000, 5));
        assert!(dir.path().join("snapshot-backup.kvs").exists());
        let _ = fs::remove_dir_all(dir.path());
    }

    /// A snapshot of a newer format (a rollback to this build) is skipped but left in place and
    /// never pruned, so that rolling forward reads it again.
    #[test]
    fn a_snapshot_of_a_newer_build_is_skipped_left_in_place_and_kept() {
        let dir = DataDir::open(temp("newer")).expect("dir");
        dir.write([image(1)], 10).expect("write");
        let newer = dir.write([image(2)], 20).expect("write").path;
        let mut bytes = fs::read(&newer).expect("read");
        bytes[8..10].copy_from_slice(&(snapshot::FORMAT_VERSION + 1).to_le_bytes());
        fs::write(&newer, bytes).expect("made newer");
        let loaded = dir.load().expect("load");
        let (_, created, _) = loaded.snapshot.expect("the older one");
        assert_eq!(created, 10);
        assert!(matches!(
            loaded.rejected[..],
            [(_, SnapshotError::NewerVersion { .. })]
        ));
        assert!(newer.is_file(), "left in place");
        // Written after it and pruned past KEEP: the newer build's file stays.
        for created in 30..30 + KEEP as i64 + 2 {
            dir.write([image(3)], created).expect("write");
        }
        assert!(newer.is_file(), "not pruned");
        assert_eq!(dir.snapshots().expect("list").len(), KEEP + 1);
        let _ = fs::remove_dir_all(dir.path());
    }

    /// The directory a server creates, its snapshots and its lock are its user's alone, whatever
    /// the umask.
    #[test]
    fn the_files_are_the_servers_users_alone() {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = |path: &Path| fs::metadata(path).expect("metadata").permissions().mode() & 0o777;
        let dir = DataDir::open(temp("modes").join("nested")).expect("dir");
        let written = dir.write([image(3)], 1_000).expect("write");
        assert_eq!(mode(dir.path()), 0o700);
        assert_eq!(mode(&written.path), 0o600);
        assert_eq!(mode(&dir.path().join(LOCK_FILE)), 0o600);
        let _ = fs::remove_dir_all(temp("modes"));
    }

    #[test]
    fn a_clock_that_steps_back_does_not_reorder_the_snapshots() {
        let dir = DataDir::open(temp("clock")).expect("dir");
        dir.write([image(1)], 1_000).expect("write");
        // The clock went back: the newer snapshot still sorts (and loads) first.
        let written = dir.write([image(2)], 500).expect("write");
        let files = dir.snapshots().expect("list");
        assert_eq!(files[0], written.path);
        let (_, created, images) = dir.load().expect("load").snapshot.expect("one");
        assert_eq!((created, images[0].snapshot.blocks()), (500, 2));
        let _ = fs::remove_dir_all(dir.path());
    }

    #[test]
    fn the_newest_readable_snapshot_wins_and_bad_ones_are_moved_aside() {
        let dir = DataDir::open(temp("load")).expect("dir");
        for (created, blocks) in [(10, 1), (20, 2), (30, 3), (40, 4)] {
            dir.write([image(blocks)], created).expect("write");
        }
        assert_eq!(
            dir.snapshots().expect("list").len(),
            KEEP,
            "old ones pruned"
        );
        // Corrupt the newest (truncate) and the next (flip a byte).
        let files = dir.snapshots().expect("list");
        let bytes = fs::read(&files[0]).expect("read");
        fs::write(&files[0], &bytes[..bytes.len() / 2]).expect("truncate");
        let mut bytes = fs::read(&files[1]).expect("read");
        bytes[20] ^= 0x40;
        fs::write(&files[1], bytes).expect("flip");
        // A temporary file of an interrupted write.
        fs::write(dir.path().join(".tmp-snapshot-x.kvs"), b"partial").expect("temp");
        let path = dir.path().to_owned();
        drop(dir);
        let dir = DataDir::open(path).expect("reopen");
        let loaded = dir.load().expect("load");
        let (path, created, images) = loaded.snapshot.expect("an older snapshot");
        assert_eq!((created, images[0].snapshot.blocks()), (20, 2), "{path:?}");
        assert_eq!(loaded.rejected.len(), 2);
        assert!(
            loaded.rejected[0].1.to_string().contains("truncated"),
            "{}",
            loaded.rejected[0].1
        );
        let names: Vec<String> = fs::read_dir(dir.path())
            .expect("list")
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.iter().filter(|n| n.ends_with(".rejected")).count(), 2);
        assert!(!names.iter().any(|n| n.starts_with(".tmp-")), "{names:?}");
        // The next load uses the same file and does not retry the rejected ones.
        let again = dir.load().expect("load");
        assert!(again.rejected.is_empty());
        let _ = fs::remove_dir_all(dir.path());
    }

    /// One holder per directory: a second open is refused while the first (or a clone of it)
    /// lives, naming the lock and what to do, and succeeds once it is gone.
    #[test]
    fn a_directory_in_use_is_refused_to_a_second_holder() {
        let first = DataDir::open(temp("locked")).expect("dir");
        let clone = first.clone();
        drop(first);
        let refused = DataDir::open(clone.path()).expect_err("the clone holds the lock");
        assert_eq!(refused.kind(), std::io::ErrorKind::ResourceBusy);
        assert!(
            refused.to_string().contains(".lock") && refused.to_string().contains("--data-dir"),
            "{refused}"
        );
        let path = clone.path().to_owned();
        drop(clone);
        let again = DataDir::open(&path).expect("free once the holder is gone");
        let _ = fs::remove_dir_all(again.path());
    }

    /// A snapshot that cannot be read for a reason of the machine's (here a directory where the
    /// file should be: EISDIR; permissions and a failing disk alike) is not moved aside: the
    /// load fails naming it, and nothing is renamed.
    #[test]
    fn a_snapshot_the_machine_cannot_read_fails_the_load_and_is_kept() {
        let dir = DataDir::open(temp("io")).expect("dir");
        dir.write([image(1)], 10).expect("write");
        let unreadable = dir.path().join("snapshot-09223372036854775807.kvs");
        fs::create_dir(&unreadable).expect("a directory in its place");
        let error = dir.load().expect_err("an I/O error fails the load");
        assert!(
            error
                .to_string()
                .contains("snapshot-09223372036854775807.kvs"),
            "{error}"
        );
        assert!(unreadable.is_dir(), "kept where it was");
        assert_eq!(
            dir.snapshots().expect("list").len(),
            2,
            "nothing moved aside"
        );
        let _ = fs::remove_dir_all(dir.path());
    }

    #[test]
    fn an_empty_or_unreadable_directory_starts_empty() {
        let dir = DataDir::open(temp("empty")).expect("dir");
        assert!(dir.load().expect("load").snapshot.is_none());
        fs::write(
            dir.path().join("snapshot-00000000000000000001.kvs"),
            b"garbage",
        )
        .expect("w");
        let loaded = dir.load().expect("load");
        assert!(loaded.snapshot.is_none());
        assert_eq!(loaded.rejected.len(), 1);
        let _ = fs::remove_dir_all(dir.path());
    }
}
