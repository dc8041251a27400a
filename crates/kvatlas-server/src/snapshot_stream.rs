//! Streaming a native snapshot (`snapshot`) of a server's indexes as chunks of bytes, for
//! `GET /snapshot` and the gRPC `Snapshot` RPC: a blocking task takes one index's image at a
//! time and encodes it into a bounded channel of 1 MiB chunks, so at most one index's cut and a
//! few chunks are in memory, whatever the size of the whole.

use std::io::{self, Write};
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::registry::{IndexKey, Registry};
use crate::served_index::unix_micros_now;
use crate::snapshot::Writer;

/// Bytes per chunk.
const CHUNK: usize = 1 << 20;
/// Chunks buffered between the encoder and the network.
const IN_FLIGHT: usize = 4;

/// Writes into the channel in [`CHUNK`]-sized pieces; fails once the receiver is gone.
struct ChannelWriter {
    tx: mpsc::Sender<io::Result<Bytes>>,
    buf: Vec<u8>,
}

impl ChannelWriter {
    fn send(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK)));
        self.tx
            .blocking_send(Ok(chunk))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the reader went away"))
    }
}

impl Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK {
            self.send()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send()
    }
}

/// The snapshot of the indexes `include` accepts, as a stream of chunks.
pub(crate) fn stream(registry: Arc<Registry>) -> ReceiverStream<io::Result<Bytes>> {
    stream_filtered(registry, |_| true)
}

/// [`stream`] of the indexes `include` accepts.
pub(crate) fn stream_filtered(
    registry: Arc<Registry>,
    include: impl Fn(&IndexKey) -> bool + Send + 'static,
) -> ReceiverStream<io::Result<Bytes>> {
    let (tx, rx) = mpsc::channel(IN_FLIGHT);
    let errors = tx.clone();
    tokio::task::spawn_blocking(move || {
        let sink = ChannelWriter {
            tx,
            buf: Vec::with_capacity(CHUNK),
        };
        let written = (|| {
            let mut writer = Writer::new(sink, unix_micros_now())?;
            for entry in registry.all() {
                if include(&entry.key) {
                    writer.index(&entry.image())?;
                }
            }
            writer.finish()?.flush()?;
            Ok::<_, crate::snapshot::SnapshotError>(())
        })();
        if let Err(error) = written {
            let _ = errors.blocking_send(Err(io::Error::other(error.to_string())));
        }
    });
    ReceiverStream::new(rx)
}
