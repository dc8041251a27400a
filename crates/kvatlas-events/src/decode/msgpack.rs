//! The msgpack deserializer the decoder runs on: `rmp-serde`'s self-describing path over a byte
//! slice, plus two hooks that let a visitor read an array or a string from its raw bytes.
//!
//! `SliceDeserializer::deserialize_any` reproduces `rmp_serde::Deserializer::from_read_ref`'s
//! (rmp-serde 1.3): the same `visit_*` call for every marker (`visit_u8` for a positive fixint,
//! `visit_i8` for a negative one, `visit_f32` for a `float32`, borrowed strings and bins, an
//! invalid-UTF-8 string offered as bytes, an ext as a newtype holding `[i8 tag, bytes]`), the
//! same nesting limit and the same [`Error`] values for truncated or malformed input (a test
//! runs both on random and mutated payloads and compares). Every other `deserialize_*` method
//! forwards to it: the tolerant visitors only ever ask for "any value".
//!
//! **Raw-array hook.** `deserialize_newtype_struct(RAW_ARRAY, visitor)` on an array hands the
//! visitor a [`SeqAccess`](de::SeqAccess) with exactly two elements instead of the array:
//!
//! 1. the bytes from the array's first element to the end of the input, as borrowed bytes
//!    (`size_hint` is the array's element count);
//! 2. either `deserialize_tuple_struct(RAW_CONSUMED, n, _)` — the visitor decoded the elements
//!    from those bytes and used `n` of them: the deserializer moves past them and visits unit —
//!    or any other request, which deserializes the array normally (nothing was consumed yet).
//!
//! A visitor thus decodes a large int array in one tight loop ([`super::fast`]) and falls back
//! to its serde path on anything unusual.
//!
//! **Raw-string hook.** `deserialize_newtype_struct(RAW_STR, visitor)` on a string consumes it
//! and calls `visit_borrowed_bytes` with its bytes, not checked for UTF-8: map keys and event
//! tags are matched against a few ASCII names, for which the check is wasted work (and an
//! invalid string cannot match one).
//!
//! On any other value, or with any other deserializer (rmp-serde calls `visit_newtype_struct`
//! with itself), a hooked visitor gets `visit_newtype_struct` and decodes as usual.

use std::io::{self, Read};

use rmp::Marker;
use rmp_serde::decode::Error;
use serde::de::{self, DeserializeSeed, Visitor};
use serde::forward_to_deserialize_any;

/// Newtype-struct name with which a visitor asks for an array's raw bytes (module docs).
pub(crate) const RAW_ARRAY: &str = "\0kvatlas::raw_array";

/// Newtype-struct name with which a visitor asks for a string's bytes without the UTF-8 check
/// (module docs).
pub(crate) const RAW_STR: &str = "\0kvatlas::raw_str";

/// Tuple-struct name with which a visitor reports how many raw bytes it consumed.
pub(crate) const RAW_CONSUMED: &str = "\0kvatlas::raw_consumed";

/// A msgpack deserializer over a byte slice (module docs).
#[derive(Debug)]
pub(crate) struct SliceDeserializer<'de> {
    input: &'de [u8],
    pos: usize,
    /// Nesting levels left, counted like rmp-serde's: entering an array, map or ext when it
    /// reaches 0 fails with [`Error::DepthLimitExceeded`].
    depth: usize,
}

/// The error `<&[u8] as Read>::read_exact` returns at the end of the input, as rmp-serde reports
/// for a marker, a fixed-size value or a length header cut short.
fn read_exact_eof() -> io::Error {
    let mut empty: &[u8] = &[];
    match empty.read_exact(&mut [0]) {
        Err(error) => error,
        Ok(()) => io::ErrorKind::UnexpectedEof.into(),
    }
}

impl<'de> SliceDeserializer<'de> {
    /// A deserializer at the start of `input`, allowing `max_depth` nesting levels (as
    /// `rmp_serde::Deserializer::set_max_depth`).
    pub(crate) fn new(input: &'de [u8], max_depth: usize) -> Self {
        Self {
            input,
            pos: 0,
            depth: max_depth,
        }
    }

    fn rest(&self) -> &'de [u8] {
        self.input.get(self.pos..).unwrap_or_default()
    }

    fn marker(&mut self) -> Result<u8, Error> {
        let (&marker, _) = self
            .rest()
            .split_first()
            .ok_or_else(|| Error::InvalidMarkerRead(read_exact_eof()))?;
        self.pos += 1;
        Ok(marker)
    }

    /// `N` bytes of a number or length header.
    fn fixed<const N: usize>(&mut self) -> Result<[u8; N], Error> {
        let bytes = *self
            .rest()
            .first_chunk::<N>()
            .ok_or_else(|| Error::InvalidDataRead(read_exact_eof()))?;
        self.pos += N;
        Ok(bytes)
    }

    /// `len` bytes of a string, bin or ext body, borrowed.
    fn slice(&mut self, len: u32) -> Result<&'de [u8], Error> {
        let bytes = usize::try_from(len)
            .ok()
            .and_then(|len| self.rest().get(..len))
            .ok_or_else(|| Error::InvalidDataRead(io::ErrorKind::UnexpectedEof.into()))?;
        self.pos += bytes.len();
        Ok(bytes)
    }

    fn len8(&mut self) -> Result<u32, Error> {
        self.fixed::<1>().map(|b| u32::from(b[0]))
    }

    fn len16(&mut self) -> Result<u32, Error> {
        self.fixed::<2>().map(|b| u32::from(u16::from_be_bytes(b)))
    }

    fn len32(&mut self) -> Result<u32, Error> {
        self.fixed::<4>().map(u32::from_be_bytes)
    }

    fn enter(&mut self) -> Result<(), Error> {
        self.depth = self.depth.saturating_sub(1);
        if self.depth == 0 {
            return Err(Error::DepthLimitExceeded);
        }
        Ok(())
    }

    fn str<V: Visitor<'de>>(&mut self, len: u32, visitor: V) -> Result<V::Value, Error> {
        let bytes = self.slice(len)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => visitor.visit_borrowed_str(s),
            // As rmp-serde: invalid UTF-8 is offered as bytes, and fails only if refused.
            Err(error) => visitor
                .visit_borrowed_bytes::<Error>(bytes)
                .map_err(|_| Error::Utf8Error(error)),
        }
    }

    fn seq<V: Visitor<'de>>(&mut self, len: u32, visitor: V) -> Result<V::Value, Error> {
        self.enter()?;
        let mut access = Access {
            de: &mut *self,
            left: len,
        };
        let value = visitor.visit_seq(&mut access)?;
        let left = access.left;
        self.depth += 1;
        match left {
            0 => Ok(value),
            excess => Err(Error::LengthMismatch(len - excess)),
        }
    }

    fn map<V: Visitor<'de>>(&mut self, len: u32, visitor: V) -> Result<V::Value, Error> {
        self.enter()?;
        let mut access = Access {
            de: &mut *self,
            left: len,
        };
        let value = visitor.visit_map(&mut access)?;
        let left = access.left;
        self.depth += 1;
        match left {
            0 => Ok(value),
            excess => Err(Error::LengthMismatch(len - excess)),
        }
    }

    fn ext<V: Visitor<'de>>(&mut self, len: u32, visitor: V) -> Result<V::Value, Error> {
        self.enter()?;
        let value = visitor.visit_newtype_struct(Ext {
            de: &mut *self,
            len,
            state: ExtState::Tag,
        });
        self.depth += 1;
        value
    }

    /// The string at the current position, consumed; `None` (nothing consumed) if the next
    /// value is not a complete string.
    fn take_str(&mut self) -> Option<&'de [u8]> {
        let rest = self.rest();
        let (header, len) = match *rest.first()? {
            m @ 0xa0..=0xbf => (1, usize::from(m & 0x1f)),
            0xd9 => (2, usize::from(*rest.get(1)?)),
            0xda => (
                3,
                usize::from(u16::from_be_bytes(*rest.get(1..)?.first_chunk()?)),
            ),
            0xdb => {
                let len = u32::from_be_bytes(*rest.get(1..)?.first_chunk()?);
                (5, usize::try_from(len).ok()?)
            }
            _ => return None,
        };
        let bytes = rest.get(header..)?.get(..len)?;
        self.pos += header + len;
        Some(bytes)
    }

    /// The element count and header length of the array at the current position, without
    /// consuming it; `None` if the next value is not a complete array header.
    fn peek_array(&self) -> Option<(u32, usize)> {
        let rest = self.rest();
        match *rest.first()? {
            m @ 0x90..=0x9f => Some((u32::from(m & 0x0f), 1)),
            0xdc => {
                let len = rest.get(1..)?.first_chunk::<2>()?;
                Some((u32::from(u16::from_be_bytes(*len)), 3))
            }
            0xdd => {
                let len = rest.get(1..)?.first_chunk::<4>()?;
                Some((u32::from_be_bytes(*len), 5))
            }
            _ => None,
        }
    }
}

impl<'de> de::Deserializer<'de> for &mut SliceDeserializer<'de> {
    type Error = Error;

    fn is_human_readable(&self) -> bool {
        false
    }

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let marker = self.marker()?;
        match marker {
            0x00..=0x7f => visitor.visit_u8(marker),
            0x80..=0x8f => self.map(u32::from(marker & 0x0f), visitor),
            0x90..=0x9f => self.seq(u32::from(marker & 0x0f), visitor),
            0xa0..=0xbf => self.str(u32::from(marker & 0x1f), visitor),
            0xc0 => visitor.visit_unit(),
            0xc1 => Err(Error::TypeMismatch(Marker::Reserved)),
            0xc2 => visitor.visit_bool(false),
            0xc3 => visitor.visit_bool(true),
            0xc4..=0xc6 => {
                let len = match marker {
                    0xc4 => self.len8()?,
                    0xc5 => self.len16()?,
                    _ => self.len32()?,
                };
                visitor.visit_borrowed_bytes(self.slice(len)?)
            }
            0xc7 => {
                let len = self.len8()?;
                self.ext(len, visitor)
            }
            0xc8 => {
                let len = self.len16()?;
                self.ext(len, visitor)
            }
            0xc9 => {
                let len = self.len32()?;
                self.ext(len, visitor)
            }
            0xca => visitor.visit_f32(f32::from_be_bytes(self.fixed()?)),
            0xcb => visitor.visit_f64(f64::from_be_bytes(self.fixed()?)),
            0xcc => visitor.visit_u8(u8::from_be_bytes(self.fixed()?)),
            0xcd => visitor.visit_u16(u16::from_be_bytes(self.fixed()?)),
            0xce => visitor.visit_u32(u32::from_be_bytes(self.fixed()?)),
            0xcf => visitor.visit_u64(u64::from_be_bytes(self.fixed()?)),
            0xd0 => visitor.visit_i8(i8::from_be_bytes(self.fixed()?)),
            0xd1 => visitor.visit_i16(i16::from_be_bytes(self.fixed()?)),
            0xd2 => visitor.visit_i32(i32::from_be_bytes(self.fixed()?)),
            0xd3 => visitor.visit_i64(i64::from_be_bytes(self.fixed()?)),
            0xd4 => self.ext(1, visitor),
            0xd5 => self.ext(2, visitor),
            0xd6 => self.ext(4, visitor),
            0xd7 => self.ext(8, visitor),
            0xd8 => self.ext(16, visitor),
            0xd9 => {
                let len = self.len8()?;
                self.str(len, visitor)
            }
            0xda => {
                let len = self.len16()?;
                self.str(len, visitor)
            }
            0xdb => {
                let len = self.len32()?;
                self.str(len, visitor)
            }
            0xdc => {
                let len = self.len16()?;
                self.seq(len, visitor)
            }
            0xdd => {
                let len = self.len32()?;
                self.seq(len, visitor)
            }
            0xde => {
                let len = self.len16()?;
                self.map(len, visitor)
            }
            0xdf => {
                let len = self.len32()?;
                self.map(len, visitor)
            }
            0xe0..=0xff => visitor.visit_i8(i8::from_ne_bytes([marker])),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        // The hook needs no nesting level of its own, but an array where nesting is exhausted
        // must fail as it would on the normal path, so that case takes it.
        if name == RAW_STR
            && let Some(bytes) = self.take_str()
        {
            return visitor.visit_borrowed_bytes(bytes);
        }
        if name == RAW_ARRAY
            && self.depth > 1
            && let Some((count, header)) = self.peek_array()
        {
            let body = self.pos + header;
            return visitor.visit_seq(RawArray {
                de: self,
                body,
                count,
                state: RawState::Bytes,
            });
        }
        visitor.visit_newtype_struct(self)
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct seq tuple tuple_struct map struct enum identifier ignored_any
    }
}

/// The elements of an array or the entries of a map.
struct Access<'a, 'de> {
    de: &'a mut SliceDeserializer<'de>,
    /// Elements (entries) not yet visited.
    left: u32,
}

impl<'de> de::SeqAccess<'de> for Access<'_, 'de> {
    type Error = Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Error> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        seed.deserialize(&mut *self.de).map(Some)
    }

    fn size_hint(&self) -> Option<usize> {
        usize::try_from(self.left).ok()
    }
}

impl<'de> de::MapAccess<'de> for Access<'_, 'de> {
    type Error = Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Error> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        seed.deserialize(&mut *self.de).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        seed.deserialize(&mut *self.de)
    }

    fn size_hint(&self) -> Option<usize> {
        usize::try_from(self.left).ok()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ExtState {
    Tag,
    Data,
    Done,
}

/// An ext value: a newtype holding the sequence `[tag as i8, data as bytes]` (rmp-serde's
/// `ExtDeserializer`).
struct Ext<'a, 'de> {
    de: &'a mut SliceDeserializer<'de>,
    len: u32,
    state: ExtState,
}

impl<'de> de::Deserializer<'de> for Ext<'_, 'de> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(mut self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_seq(&mut self)
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map struct enum identifier
        ignored_any
    }
}

impl<'de> de::SeqAccess<'de> for &mut Ext<'_, 'de> {
    type Error = Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Error> {
        match self.state {
            ExtState::Tag | ExtState::Data => seed.deserialize(&mut **self).map(Some),
            ExtState::Done => Ok(None),
        }
    }
}

impl<'de> de::Deserializer<'de> for &mut Ext<'_, 'de> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self.state {
            ExtState::Tag => {
                let tag = i8::from_be_bytes(self.de.fixed()?);
                self.state = ExtState::Data;
                visitor.visit_i8(tag)
            }
            ExtState::Data => {
                let data = self.de.slice(self.len)?;
                self.state = ExtState::Done;
                visitor.visit_borrowed_bytes(data)
            }
            ExtState::Done => Err(Error::TypeMismatch(Marker::Reserved)),
        }
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map struct enum identifier
        ignored_any
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RawState {
    Bytes,
    Settle,
    Done,
}

/// The raw-array hook's two elements (module docs).
struct RawArray<'a, 'de> {
    de: &'a mut SliceDeserializer<'de>,
    /// Input offset of the array's first element (the header is not consumed until settled).
    body: usize,
    count: u32,
    state: RawState,
}

impl<'de> de::SeqAccess<'de> for RawArray<'_, 'de> {
    type Error = Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Error> {
        match self.state {
            RawState::Bytes => {
                self.state = RawState::Settle;
                let bytes = self.de.input.get(self.body..).unwrap_or_default();
                seed.deserialize(RawBytes(bytes)).map(Some)
            }
            RawState::Settle => {
                self.state = RawState::Done;
                seed.deserialize(Settle {
                    de: &mut *self.de,
                    body: self.body,
                })
                .map(Some)
            }
            RawState::Done => Ok(None),
        }
    }

    fn size_hint(&self) -> Option<usize> {
        usize::try_from(self.count).ok()
    }
}

/// The raw-array hook's first element: the bytes from the first array element on.
struct RawBytes<'de>(&'de [u8]);

impl<'de> de::Deserializer<'de> for RawBytes<'de> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_borrowed_bytes(self.0)
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map struct enum identifier
        ignored_any
    }
}

/// The raw-array hook's second element: "consumed `n` bytes" or the array itself.
struct Settle<'a, 'de> {
    de: &'a mut SliceDeserializer<'de>,
    body: usize,
}

impl<'de> de::Deserializer<'de> for Settle<'_, 'de> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.de.deserialize_any(visitor)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        consumed: usize,
        visitor: V,
    ) -> Result<V::Value, Error> {
        if name != RAW_CONSUMED {
            return self.de.deserialize_any(visitor);
        }
        let end = self
            .body
            .checked_add(consumed)
            .filter(|end| *end <= self.de.input.len())
            .ok_or_else(|| <Error as de::Error>::custom("raw array consumed past the input"))?;
        self.de.pos = end;
        visitor.visit_unit()
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple map struct enum identifier ignored_any
    }
}

/// Visitor side of the raw-array hook: decodes the array from its raw bytes with `fast`
/// (`(bytes from the first element, element count) → (value, bytes used)`), or, when `fast`
/// declines, with `slow` on the normal path. `raw` is the hook's [`SeqAccess`](de::SeqAccess).
pub(crate) fn raw_array<'de, A, T, S>(
    mut raw: A,
    fast: impl FnOnce(&'de [u8], usize) -> Option<(T, usize)>,
    slow: S,
) -> Result<T, A::Error>
where
    A: de::SeqAccess<'de>,
    S: DeserializeSeed<'de, Value = T>,
{
    let count = raw.size_hint().unwrap_or(0);
    if let Some(Borrowed(bytes)) = raw.next_element()?
        && let Some((value, used)) = fast(bytes, count)
    {
        raw.next_element_seed(Consumed(used))?;
        return Ok(value);
    }
    raw.next_element_seed(slow)?
        .ok_or_else(|| de::Error::custom("raw array hook ended early"))
}

/// Borrowed bytes (the hook's first element).
struct Borrowed<'de>(&'de [u8]);

impl<'de> de::Deserialize<'de> for Borrowed<'de> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Borrowed<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("borrowed bytes")
            }
            fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<Self::Value, E> {
                Ok(Borrowed(v))
            }
        }
        d.deserialize_bytes(V)
    }
}

/// "`n` raw bytes were consumed" (the hook's second element, fast case).
struct Consumed(usize);

impl<'de> DeserializeSeed<'de> for Consumed {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_tuple_struct(RAW_CONSUMED, self.0, de::IgnoredAny)
            .map(|_| ())
    }
}
