//! [`FastJson`]: axum's `Json` extractor for the hot query routes, without its per-value cost.
//!
//! axum's `Json<T>` deserializes through `serde_path_to_error`, which tracks the path of every
//! value it parses so that an error can name the field. On a Dynamo `/query` of 1,024 token ids
//! that tracking is paid 1,024 times; perf put the request's JSON parsing at over a third of the
//! server's CPU per query, the tracking at a third of that. [`FastJson`] parses a body whose
//! content type is exactly `application/json` with `serde_json` directly — the same grammar and
//! the same `Deserialize` impls, so it accepts exactly what `Json` accepts — and only when that
//! fails (or for any other content type) hands the request to axum's `Json`, so every rejection
//! keeps axum's status code and text (415, 400, 422: what Dynamo's service, an axum server too,
//! answers; `tests/dynamo_compat.rs` checks them against it).
//!
//! A request type may go one step further ([`FastParse`]): `/query`'s token ids are read by
//! [`parse_u32_array`] from the array's raw text, falling back to `serde_json` for anything
//! but plain unsigned integers.

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::header;
use serde::de::{self, DeserializeOwned};
use serde::{Deserialize, Deserializer};
use std::marker::PhantomData;

/// A JSON request body, parsed as axum's `Json<T>` would parse it (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FastJson<T>(pub(crate) T);

/// A request type that may parse the common case faster than `serde_json`.
pub(crate) trait FastParse: DeserializeOwned {
    /// `Some` only with exactly the value `serde_json::from_slice(bytes)` gives; `None` sends
    /// the body through `serde_json` (and its errors through axum).
    fn fast_parse(bytes: &[u8]) -> Option<Self> {
        let _ = bytes;
        None
    }
}

impl<T, S> FromRequest<S> for FastJson<T>
where
    T: FastParse,
    S: Send + Sync,
{
    type Rejection = JsonRejection;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let plain_json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"application/json"));
        if !plain_json {
            // Parameters, `+json` types and a missing or wrong type: axum decides.
            return Json::<T>::from_request(req, state)
                .await
                .map(|Json(value)| Self(value));
        }
        let bytes = Bytes::from_request(req, state).await?;
        if let Some(value) = T::fast_parse(&bytes) {
            return Ok(Self(value));
        }
        match serde_json::from_slice(&bytes) {
            Ok(value) => Ok(Self(value)),
            // axum's own parse names the problem (and its path) in axum's words.
            Err(_) => Json::<T>::from_bytes(&bytes).map(|Json(value)| Self(value)),
        }
    }
}

/// A JSON array of which only the first `kvatlas_proto::codec::token_ids_kept()` elements are
/// kept (a query holding that many ids or block hashes is refused whatever the rest are: a
/// block holds at least one token). The others are read and checked as `T`s, then dropped, so
/// every body gets the value or the error a `Vec<T>` gives it (the same expectation, "a
/// sequence", and the same element errors), without holding more ids than any limit accepts.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct KeepFirst<T>(pub(crate) Vec<T>);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for KeepFirst<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Self::keeping(deserializer, kvatlas_proto::codec::token_ids_kept())
    }
}

impl<'de, T: Deserialize<'de>> KeepFirst<T> {
    /// The array's first `keep` elements (every element read and checked).
    fn keeping<D: Deserializer<'de>>(deserializer: D, keep: usize) -> Result<Self, D::Error> {
        struct Visitor<T> {
            keep: usize,
            element: PhantomData<T>,
        }
        impl<'de, T: Deserialize<'de>> de::Visitor<'de> for Visitor<T> {
            type Value = KeepFirst<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                // serde's words for a `Vec`.
                f.write_str("a sequence")
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut kept = Vec::new();
                while let Some(value) = seq.next_element::<T>()? {
                    if kept.len() < self.keep {
                        kept.push(value);
                    }
                }
                Ok(KeepFirst(kept))
            }
        }
        deserializer.deserialize_seq(Visitor {
            keep,
            element: PhantomData,
        })
    }
}

/// The unsigned 32-bit integers of a JSON array's text (`[1, 2,3]`), or `None` unless every
/// element is a plain integer (`0` or no leading zero, no sign, fraction or exponent) within
/// `u32` and the text is nothing but the array: the caller then parses it with `serde_json`,
/// which accepts exactly these texts too and reports every other one. Whitespace is JSON's.
///
/// Only the first `keep` integers are kept (the rest are read and checked, not stored), as
/// [`KeepFirst`] keeps them: a body of one-digit ids would otherwise become twice its size in
/// memory before the server's limit could refuse it.
pub(crate) fn parse_u32_array(text: &str, keep: usize) -> Option<Vec<u32>> {
    let bytes = text.as_bytes();
    let mut at = 0;
    let skip_space = |at: &mut usize| {
        while bytes
            .get(*at)
            .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        {
            *at += 1;
        }
    };
    skip_space(&mut at);
    if bytes.get(at) != Some(&b'[') {
        return None;
    }
    at += 1;
    skip_space(&mut at);
    // Token ids take 2–7 bytes each with their comma.
    let mut values = Vec::with_capacity((bytes.len() / 4).min(keep));
    if bytes.get(at) == Some(&b']') {
        at += 1;
    } else {
        loop {
            let first = *bytes.get(at)?;
            let mut value = u64::from(first.wrapping_sub(b'0'));
            if value > 9 {
                return None;
            }
            at += 1;
            if first != b'0' {
                while let Some(&digit) = bytes.get(at).filter(|b| b.is_ascii_digit()) {
                    value = value * 10 + u64::from(digit - b'0');
                    if value > u64::from(u32::MAX) {
                        return None;
                    }
                    at += 1;
                }
            }
            // A fraction, an exponent or a digit after a leading zero: serde_json decides.
            if bytes
                .get(at)
                .is_some_and(|b| matches!(b, b'.' | b'e' | b'E' | b'0'..=b'9'))
            {
                return None;
            }
            let value = u32::try_from(value).ok()?;
            if values.len() < keep {
                values.push(value);
            }
            skip_space(&mut at);
            match bytes.get(at)? {
                b',' => {
                    at += 1;
                    skip_space(&mut at);
                }
                b']' => {
                    at += 1;
                    break;
                }
                _ => return None,
            }
        }
    }
    skip_space(&mut at);
    (at == bytes.len()).then_some(values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use serde::Deserialize;

    #[derive(Debug, Deserialize, PartialEq)]
    struct Probe {
        token_ids: Vec<u32>,
        model_name: String,
        #[serde(default)]
        top_k: Option<u32>,
    }

    impl FastParse for Probe {}

    /// `/query`'s own fast parse (token ids from their raw text) keeps the equivalence.
    #[tokio::test]
    async fn query_requests_are_read_exactly_as_axums_json_reads_them() {
        use crate::dynamo::QueryRequest;
        async fn outcome<E: FromRequest<()>>(
            body: &str,
            show: impl Fn(E) -> String,
            reject: impl Fn(E::Rejection) -> (u16, String),
        ) -> Result<String, (u16, String)> {
            E::from_request(request(Some("application/json"), body), &())
                .await
                .map(show)
                .map_err(reject)
        }
        for body in [
            r#"{"model_name":"m","token_ids":[1,2,3]}"#,
            r#"{"model":"m","token_ids":[ 0 , 4294967295 ],"lora_name":"a","instance_id":3}"#,
            r#"{"modelname":"m","token_ids":[],"routing_group":"g","block_size":16}"#,
            r#"{"model_name":"m","token_ids":[1,-2]}"#,
            r#"{"model_name":"m","token_ids":[1.5]}"#,
            r#"{"model_name":"m","token_ids":[4294967296]}"#,
            r#"{"model_name":"m","token_ids":[1],"token_ids":[2]}"#,
            r#"{"model_name":"m","token_ids":{"a":1}}"#,
            r#"{"model_name":"m"}"#,
            r#"{"model_name":"m","token_ids":[1,2"#,
            r#"{"model_name":"m","token_ids":[1],"lora_id":7}"#,
        ] {
            let fast = outcome::<FastJson<QueryRequest>>(
                body,
                |FastJson(q)| format!("{q:?}"),
                |e| (e.status().as_u16(), e.body_text()),
            )
            .await;
            let axum_json = outcome::<Json<QueryRequest>>(
                body,
                |Json(q)| format!("{q:?}"),
                |e| (e.status().as_u16(), e.body_text()),
            )
            .await;
            assert_eq!(fast, axum_json, "{body}");
        }
    }

    /// The fast path is taken only where it gives serde_json's value: on arrays written every
    /// way JSON allows, and on mangled texts.
    #[test]
    fn u32_arrays_are_read_as_serde_json_reads_them() {
        use proptest::prelude::*;
        let serde = |text: &str| serde_json::from_str::<Vec<u32>>(text).ok();
        for text in [
            "[]",
            " [ ] ",
            "[0]",
            "[4294967295]",
            "[1,2,3]",
            "\t[ 1 ,\n2\r, 3 ]\n",
            "[4294967296]",
            "[-1]",
            "[01]",
            "[1.0]",
            "[1e2]",
            "[1,]",
            "[,1]",
            "[1 2]",
            "[1]]",
            "[1] x",
            "",
            "[",
            "[\"1\"]",
            "[null]",
            "[+1]",
            "[00]",
            "[1.]",
        ] {
            let fast = parse_u32_array(text, usize::MAX);
            if fast.is_some() {
                assert_eq!(fast, serde(text), "{text:?}");
            }
        }
        assert_eq!(parse_u32_array("[1,2,3]", 3), Some(vec![1, 2, 3]));
        assert_eq!(parse_u32_array("[4294967295]", 1), Some(vec![u32::MAX]));
        assert_eq!(parse_u32_array("[4294967296]", 1), None);
        assert_eq!(parse_u32_array("[01]", 1), None);
        // Past `keep`, the ids are still read and checked, not kept.
        assert_eq!(parse_u32_array("[1,2,3]", 2), Some(vec![1, 2]));
        assert_eq!(parse_u32_array("[1,2,3]", 0), Some(vec![]));
        assert_eq!(parse_u32_array("[1,2,4294967296]", 2), None);
        assert_eq!(parse_u32_array("[1,2,3] x", 2), None);
        let space = prop::sample::select(vec!["", " ", "\n", "\t", "\r", "  "]);
        let arrays = prop::collection::vec((any::<u32>(), space.clone(), space.clone()), 0..40);
        proptest!(|(values in arrays, edge in space, junk in prop::collection::vec(any::<u8>(), 0..4), cut in any::<prop::sample::Index>())| {
            let mut text = format!("{edge}[");
            for (i, (value, before, after)) in values.iter().enumerate() {
                if i > 0 {
                    text.push(',');
                }
                text.push_str(&format!("{before}{value}{after}"));
            }
            text.push_str(&format!("]{edge}"));
            let expected: Vec<u32> = values.iter().map(|v| v.0).collect();
            prop_assert_eq!(parse_u32_array(&text, usize::MAX), Some(expected.clone()));
            let keep = cut.index(expected.len() + 1);
            prop_assert_eq!(parse_u32_array(&text, keep), Some(expected[..keep].to_vec()));
            // Mangled: a byte of junk put somewhere; whatever the fast path still takes,
            // serde_json takes too, with the same value.
            let mut bytes = text.into_bytes();
            let at = cut.index(bytes.len() + 1);
            for (k, b) in junk.iter().enumerate() {
                bytes.insert((at + k).min(bytes.len()), *b);
            }
            if let Ok(mangled) = std::str::from_utf8(&bytes)
                && let Some(fast) = parse_u32_array(mangled, usize::MAX)
            {
                prop_assert_eq!(Some(fast), serde(mangled), "{:?}", mangled);
            }
        });
    }

    /// `KeepFirst` keeps the first elements and reads every body as a `Vec` does: the same
    /// value up to its length, the same error (and so the same rejection from axum).
    #[test]
    fn keep_first_reads_every_array_as_a_vec_and_keeps_its_first_elements() {
        fn keeping(text: &str, keep: usize) -> Result<Vec<u32>, String> {
            let mut deserializer = serde_json::Deserializer::from_str(text);
            KeepFirst::<u32>::keeping(&mut deserializer, keep)
                .and_then(|kept| deserializer.end().map(|()| kept.0))
                .map_err(|e| e.to_string())
        }
        let as_vec = |text: &str| serde_json::from_str::<Vec<u32>>(text).map_err(|e| e.to_string());
        for text in [
            "[]",
            "[1,2,3]",
            " [ 1 , 2 ] ",
            "[1,-2,3]",
            "[1,2,4294967296]",
            "[1,2,\"3\"]",
            "\"1,2\"",
            "{\"a\":1}",
            "null",
            "[1,2",
            "[1,2,]",
        ] {
            for keep in [0, 1, 2, 5] {
                let expected = as_vec(text).map(|all| all.into_iter().take(keep).collect());
                assert_eq!(keeping(text, keep), expected, "{text:?}, keep {keep}");
            }
        }
        assert_eq!(keeping("[7,8,9]", 2), Ok(vec![7, 8]));
        assert!(
            keeping("[7,8,-9]", 2).is_err(),
            "elements past keep are checked"
        );
    }

    fn request(content_type: Option<&str>, body: &str) -> Request {
        let mut request = Request::builder().method("POST").uri("/");
        if let Some(content_type) = content_type {
            request = request.header(header::CONTENT_TYPE, content_type);
        }
        request
            .body(Body::from(body.to_owned()))
            .expect("a valid request")
    }

    /// The value, or the rejection's status and text.
    type Outcome = Result<Probe, (u16, String)>;

    async fn with_axum(content_type: Option<&str>, body: &str) -> Outcome {
        Json::<Probe>::from_request(request(content_type, body), &())
            .await
            .map(|Json(probe)| probe)
            .map_err(|e| (e.status().as_u16(), e.body_text()))
    }

    async fn with_fast(content_type: Option<&str>, body: &str) -> Outcome {
        FastJson::<Probe>::from_request(request(content_type, body), &())
            .await
            .map(|FastJson(probe)| probe)
            .map_err(|e| (e.status().as_u16(), e.body_text()))
    }

    #[tokio::test]
    async fn answers_every_body_exactly_as_axums_json_does() {
        let json = Some("application/json");
        let cases: &[(Option<&str>, &str)] = &[
            (json, r#"{"token_ids":[1,2,3],"model_name":"m"}"#),
            (
                json,
                r#" { "model_name" : "m", "token_ids" : [ ], "top_k": 4 } "#,
            ),
            (
                Some("Application/JSON"),
                r#"{"token_ids":[7],"model_name":"m"}"#,
            ),
            (
                Some("application/json; charset=utf-8"),
                r#"{"token_ids":[7],"model_name":"m"}"#,
            ),
            (
                Some("application/vnd.kv+json"),
                r#"{"token_ids":[7],"model_name":"m"}"#,
            ),
            // Wrong shapes (422), with the path of the bad value in the text.
            (json, r#"{"token_ids":[1,-2,3],"model_name":"m"}"#),
            (json, r#"{"token_ids":[1,4294967296],"model_name":"m"}"#),
            (json, r#"{"token_ids":"1,2","model_name":"m"}"#),
            (json, r#"{"token_ids":[1,2]}"#),
            (json, r#"{"token_ids":[1],"model_name":"m","top_k":"x"}"#),
            // Not JSON (400).
            (json, r#"{"token_ids":[1,2,"#),
            (json, r#"{"token_ids":[1],"model_name":"m"} trailing"#),
            (json, ""),
            // Not declared as JSON (415).
            (None, r#"{"token_ids":[1],"model_name":"m"}"#),
            (Some("text/plain"), r#"{"token_ids":[1],"model_name":"m"}"#),
        ];
        let mut statuses = std::collections::BTreeSet::new();
        for &(content_type, body) in cases {
            let expected = with_axum(content_type, body).await;
            let got = with_fast(content_type, body).await;
            assert_eq!(
                got, expected,
                "content type {content_type:?}, body {body:?}"
            );
            statuses.insert(got.map_or_else(|(status, _)| status, |_| 200));
        }
        // The cases cover acceptance and each kind of rejection.
        assert_eq!(
            statuses.into_iter().collect::<Vec<_>>(),
            vec![200, 400, 415, 422]
        );
    }
}
