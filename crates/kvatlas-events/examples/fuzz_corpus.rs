//! Writes the fuzz seed corpus: every byte-exact decoding fixture of `tests/common/mod.rs`
//! (`common::all()`), one file per fixture named after it, into the directory given as the only
//! argument (created if missing; existing files of the same name are overwritten, others are
//! left alone). `cargo xtask fuzz-corpus` runs it for `fuzz/corpus/decode_batch/`;
//! `tests/fixtures.rs` checks that the committed corpus is what it writes.

use std::path::Path;
use std::process::ExitCode;

#[path = "../tests/common/mod.rs"]
mod common;

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let (Some(dir), None) = (args.next(), args.next()) else {
        eprintln!("usage: fuzz_corpus DIR");
        return ExitCode::from(2);
    };
    let dir = Path::new(&dir);
    match write_corpus(dir) {
        Ok(count) => {
            eprintln!("wrote {count} seed(s) to {}", dir.display());
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("fuzz_corpus: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Writes every fixture into `dir`; returns how many.
fn write_corpus(dir: &Path) -> Result<usize, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let seeds = common::all();
    for (name, bytes) in &seeds {
        let path = dir.join(name);
        std::fs::write(&path, bytes)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(seeds.len())
}
