//! ZMQ message framing of live and replayed batches (`docs/events.md` §7.1 and §7.4), without
//! sockets.
//!
//! Frames are passed as `&[&[u8]]`, one slice per ZMQ frame, exactly as received.

/// The end-of-replay sequence number (`0xFFFF_FFFF_FFFF_FFFF`, sent with an empty payload).
pub const REPLAY_END_SEQ: u64 = u64::MAX;

/// Why a multipart message was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The message has a number of frames no producer sends.
    #[error("{count} frame(s); expected {expected}")]
    FrameCount {
        /// Frames received.
        count: usize,
        /// What the layout allows.
        expected: &'static str,
    },
    /// The sequence frame is not exactly 8 bytes.
    #[error("sequence frame has {len} byte(s), expected 8")]
    SeqLength {
        /// Its length.
        len: usize,
    },
    /// A 4-frame replay reply whose first frame is not the empty delimiter.
    #[error("4-frame replay reply without the empty delimiter frame")]
    MissingDelimiter,
    /// A live batch numbered with the end-marker sequence number, which no engine reaches (it
    /// would also pin the source's next expected number at the top of the range).
    #[error("live batch with the reserved end-marker sequence number")]
    ReservedSeq,
    /// The end-marker sequence number with a non-empty payload.
    #[error("end-marker sequence number with a {len}-byte payload")]
    EndMarkerWithPayload {
        /// The payload's length.
        len: usize,
    },
}

/// A live message: `[topic, seq (8 bytes BE), payload]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveMessage<'a> {
    /// The topic frame (possibly empty).
    pub topic: &'a [u8],
    /// The batch's sequence number.
    pub seq: u64,
    /// The msgpack batch.
    pub payload: &'a [u8],
}

/// Parses a live PUB message: exactly 3 frames `[topic, seq, payload]`.
///
/// # Errors
/// [`FrameError::FrameCount`], [`FrameError::SeqLength`], or [`FrameError::ReservedSeq`] for
/// the sequence number [`REPLAY_END_SEQ`].
pub fn decode_live_message<'a>(frames: &[&'a [u8]]) -> Result<LiveMessage<'a>, FrameError> {
    match frames {
        [topic, seq, payload] => Ok(LiveMessage {
            topic,
            seq: match decode_seq(seq)? {
                REPLAY_END_SEQ => return Err(FrameError::ReservedSeq),
                seq => seq,
            },
            payload,
        }),
        _ => Err(FrameError::FrameCount {
            count: frames.len(),
            expected: "3",
        }),
    }
}

/// One reply of a replay ROUTER, as read by a DEALER.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayReply<'a> {
    /// A replayed batch.
    Batch {
        /// The topic frame of vLLM ≥ 0.26 / SGLang ≥ 0.5.22 replies (empty for older ones,
        /// and when the topic is empty).
        topic: &'a [u8],
        /// The batch's sequence number.
        seq: u64,
        /// The msgpack batch.
        payload: &'a [u8],
    },
    /// The end marker: no more replies to this request.
    End,
}

/// Parses a replay reply, with or without the DEALER's empty delimiter frame:
///
/// | Frames | Layout |
/// |---|---|
/// | 2 | `[seq, payload]` (body only, old layout) |
/// | 3 | `[b"", seq, payload]` (old layout) or `[topic, seq, payload]` (new layout, body only) |
/// | 4 | `[b"", topic, seq, payload]` (new layout) |
///
/// A reply with sequence `u64::MAX` and an empty payload is [`ReplayReply::End`].
///
/// # Errors
/// A [`FrameError`] for another frame count, a sequence frame that is not 8 bytes, a 4-frame
/// reply without the empty delimiter, or an end-marker sequence with a payload.
pub fn decode_replay_reply<'a>(frames: &[&'a [u8]]) -> Result<ReplayReply<'a>, FrameError> {
    let (topic, seq, payload): (&[u8], _, _) = match frames {
        [seq, payload] => (&[], seq, payload),
        [topic, seq, payload] => (topic, seq, payload),
        [delimiter, topic, seq, payload] => {
            if !delimiter.is_empty() {
                return Err(FrameError::MissingDelimiter);
            }
            (topic, seq, payload)
        }
        _ => {
            return Err(FrameError::FrameCount {
                count: frames.len(),
                expected: "2, 3 or 4",
            });
        }
    };
    let seq = decode_seq(seq)?;
    if seq == REPLAY_END_SEQ {
        return if payload.is_empty() {
            Ok(ReplayReply::End)
        } else {
            Err(FrameError::EndMarkerWithPayload { len: payload.len() })
        };
    }
    Ok(ReplayReply::Batch {
        topic,
        seq,
        payload,
    })
}

/// The start-sequence frame of a replay request; a DEALER sends `[b"", replay_request(start)]`.
pub fn replay_request(start: u64) -> [u8; 8] {
    start.to_be_bytes()
}

fn decode_seq(frame: &[u8]) -> Result<u64, FrameError> {
    <[u8; 8]>::try_from(frame)
        .map(u64::from_be_bytes)
        .map_err(|_| FrameError::SeqLength { len: frame.len() })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEQ3: [u8; 8] = [0, 0, 0, 0, 0, 0, 0, 3];
    const END: [u8; 8] = [0xff; 8];

    #[test]
    fn live_messages_need_three_frames_and_an_eight_byte_seq() {
        let m = decode_live_message(&[b"kv-events", &SEQ3, b"\x93"]).expect("valid");
        assert_eq!(
            (m.topic, m.seq, m.payload),
            (&b"kv-events"[..], 3, &b"\x93"[..])
        );
        assert!(matches!(
            decode_live_message(&[&SEQ3, b"x"]),
            Err(FrameError::FrameCount { count: 2, .. })
        ));
        assert_eq!(
            decode_live_message(&[b"", &SEQ3[1..], b"x"]),
            Err(FrameError::SeqLength { len: 7 })
        );
        assert_eq!(
            decode_live_message(&[b"", &END, b"x"]),
            Err(FrameError::ReservedSeq)
        );
        let below_end = (REPLAY_END_SEQ - 1).to_be_bytes();
        let m = decode_live_message(&[b"", &below_end, b"x"]).expect("valid");
        assert_eq!(m.seq, REPLAY_END_SEQ - 1);
    }

    #[test]
    fn replay_replies_in_every_layout() {
        let batch = |topic: &'static [u8]| ReplayReply::Batch {
            topic,
            seq: 3,
            payload: b"p",
        };
        assert_eq!(decode_replay_reply(&[&SEQ3, b"p"]), Ok(batch(b"")));
        assert_eq!(decode_replay_reply(&[b"", &SEQ3, b"p"]), Ok(batch(b"")));
        assert_eq!(decode_replay_reply(&[b"kv", &SEQ3, b"p"]), Ok(batch(b"kv")));
        assert_eq!(
            decode_replay_reply(&[b"", b"kv", &SEQ3, b"p"]),
            Ok(batch(b"kv"))
        );
        assert_eq!(
            decode_replay_reply(&[b"x", b"kv", &SEQ3, b"p"]),
            Err(FrameError::MissingDelimiter)
        );
        // End markers: [seq, ""], ["", seq, ""], ["", "", seq, ""].
        assert_eq!(decode_replay_reply(&[&END, b""]), Ok(ReplayReply::End));
        assert_eq!(decode_replay_reply(&[b"", &END, b""]), Ok(ReplayReply::End));
        assert_eq!(
            decode_replay_reply(&[b"", b"", &END, b""]),
            Ok(ReplayReply::End)
        );
        assert_eq!(
            decode_replay_reply(&[&END, b"x"]),
            Err(FrameError::EndMarkerWithPayload { len: 1 })
        );
        assert!(decode_replay_reply(&[b"only"]).is_err());
        assert_eq!(replay_request(3), SEQ3);
    }
}
