//! Reading a file an operator names (a config file, a token or credentials file) with a bound on
//! its size: a path pointed by mistake at a large file, or at `/dev/zero`, is refused with its
//! size, not read until the memory runs out (a token file is read again at every reload check).

use std::io::Read as _;
use std::path::Path;

/// The most bytes of a config file.
pub(crate) const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// The most bytes of a token file (`--auth-tokens`: many tokens, each a line).
pub(crate) const MAX_TOKEN_FILE_BYTES: u64 = 16 << 20;
/// The most bytes of a NATS token, NKey seed or credentials file.
pub(crate) const MAX_SECRET_FILE_BYTES: u64 = 1 << 20;

/// Reads `path` as UTF-8 text of at most `max_bytes`.
///
/// # Errors
/// The I/O error; [`std::io::ErrorKind::InvalidData`] for text that is not UTF-8 or a file
/// larger than `max_bytes` (saying so).
pub(crate) fn read_text_within(path: &Path, max_bytes: u64) -> std::io::Result<String> {
    // The size first, then the text: a long file cut inside a character is too long, not
    // "not UTF-8".
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(max_bytes.saturating_add(1))
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max_bytes {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {max_bytes} bytes: not such a file"),
        ));
    }
    String::from_utf8(bytes).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not UTF-8 text: not such a file",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file within the bound is read whole; a larger one (and an endless one) is refused
    /// saying why, after reading one byte more than the bound.
    #[test]
    fn a_file_beyond_the_bound_is_refused() {
        let path = std::env::temp_dir().join(format!("kvatlas-bounded-{}", std::process::id()));
        std::fs::write(&path, "0123456789").expect("write");
        assert_eq!(read_text_within(&path, 10).expect("within"), "0123456789");
        let refused = read_text_within(&path, 9).expect_err("beyond");
        assert_eq!(refused.kind(), std::io::ErrorKind::InvalidData);
        assert!(
            refused.to_string().contains("larger than 9 bytes"),
            "{refused}"
        );
        // Cut inside a character: still too long, not "not UTF-8".
        std::fs::write(&path, "12345678\u{e9}").expect("write");
        let refused = read_text_within(&path, 8).expect_err("beyond");
        assert!(
            refused.to_string().contains("larger than 8 bytes"),
            "{refused}"
        );
        std::fs::write(&path, [0xff, 0xfe]).expect("write");
        let refused = read_text_within(&path, 8).expect_err("not text");
        assert!(refused.to_string().contains("not UTF-8"), "{refused}");
        let _ = std::fs::remove_file(&path);
        let endless = read_text_within(Path::new("/dev/zero"), 1 << 10).expect_err("endless");
        assert!(endless.to_string().contains("larger than"), "{endless}");
    }
}
