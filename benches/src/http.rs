//! A minimal HTTP/1.1 keep-alive client for the end-to-end benchmark: requests are serialized
//! once and written as bytes, responses are read by `Content-Length`. Both services under test
//! (kvatlas's and Dynamo's indexer, axum servers both) answer every route the benchmark uses
//! with a `Content-Length`; a chunked answer is reported as an error, never guessed at.
//!
//! The same client, with the same bytes, talks to both services, so its own cost (which the
//! load generator pays on the machine's shared cores) is the same for both.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// A `POST path` request with a JSON body, as bytes.
pub fn post_json(path: &str, body: &[u8]) -> Vec<u8> {
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    request
}

/// A `GET path` request, as bytes.
pub fn get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").into_bytes()
}

/// Where a complete response sits in a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Parsed {
    status: u16,
    body_start: usize,
    end: usize,
}

/// Parses the response at the start of `buf`: `None` while it is incomplete.
fn parse(buf: &[u8]) -> Result<Option<Parsed>> {
    let Some(head_end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        if buf.len() > 64 << 10 {
            bail!("a response head over 64 KiB");
        }
        return Ok(None);
    };
    let head = std::str::from_utf8(&buf[..head_end]).context("a response head not in UTF-8")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("a bad status line {status_line:?}"))?;
    let mut length = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        if name.eq_ignore_ascii_case("content-length") {
            length = Some(
                value
                    .trim()
                    .parse::<usize>()
                    .context("a bad Content-Length")?,
            );
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            bail!("a {} response (only Content-Length is read)", value.trim());
        }
    }
    let length = match (length, status) {
        (Some(length), _) => length,
        (None, 204 | 304) => 0,
        (None, _) => bail!("a {status} response without Content-Length"),
    };
    let body_start = head_end + 4;
    Ok((buf.len() >= body_start + length).then_some(Parsed {
        status,
        body_start,
        end: body_start + length,
    }))
}

/// A blocking keep-alive connection (set-up calls, probes, exactness checks).
#[derive(Debug)]
pub struct Connection {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Connection {
    /// Connects to `addr` (`host:port`).
    pub fn connect(addr: &str) -> Result<Self> {
        let stream = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        Ok(Self {
            stream,
            buf: Vec::with_capacity(64 << 10),
        })
    }

    /// Sends a serialized request and returns the status and body of its response.
    pub fn send(&mut self, request: &[u8]) -> Result<(u16, Vec<u8>)> {
        self.stream.write_all(request)?;
        self.buf.clear();
        let mut chunk = [0u8; 16 << 10];
        loop {
            if let Some(parsed) = parse(&self.buf)? {
                return Ok((
                    parsed.status,
                    self.buf[parsed.body_start..parsed.end].to_vec(),
                ));
            }
            let n = self.stream.read(&mut chunk)?;
            if n == 0 {
                bail!("the server closed the connection mid-response");
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// `POST path` with a JSON body; the status and body of the answer.
    pub fn post(&mut self, path: &str, body: &serde_json::Value) -> Result<(u16, Vec<u8>)> {
        self.send(&post_json(path, &serde_json::to_vec(body)?))
    }
}

/// An asynchronous keep-alive connection (the load generator's).
#[derive(Debug)]
pub struct AsyncConnection {
    stream: tokio::net::TcpStream,
    buf: Vec<u8>,
}

impl AsyncConnection {
    /// Connects to `addr` (`host:port`).
    pub async fn connect(addr: &str) -> Result<Self> {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        stream.set_nodelay(true)?;
        Ok(Self {
            stream,
            buf: Vec::with_capacity(64 << 10),
        })
    }

    /// Sends a serialized request and returns its response's status (the body is read and
    /// dropped).
    ///
    /// Written with `try_write`/`try_read` on readiness (tokio's `net` feature alone), so the
    /// benchmark builds tokio with the server's feature set and the two never rebuild each other.
    pub async fn send(&mut self, request: &[u8]) -> Result<u16> {
        let mut written = 0;
        while written < request.len() {
            self.stream.writable().await?;
            match self.stream.try_write(&request[written..]) {
                Ok(n) => written += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.buf.clear();
        let mut chunk = [0u8; 16 << 10];
        loop {
            if let Some(parsed) = parse(&self.buf)? {
                return Ok(parsed.status);
            }
            self.stream.readable().await?;
            match self.stream.try_read(&mut chunk) {
                Ok(0) => bail!("the server closed the connection mid-response"),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// `(upper bound in seconds, cumulative count)` of histogram `name` in the server's `/metrics`
/// at `addr`, summed over its label sets, by ascending bound.
///
/// # Errors
/// If the server cannot be reached or does not answer 200.
pub fn histogram_buckets(addr: &str, name: &str) -> Result<Vec<(f64, u64)>> {
    let mut c = Connection::connect(addr)?;
    let (status, body) = c.send(&get("/metrics"))?;
    if status != 200 {
        bail!("GET /metrics on {addr}: {status}");
    }
    Ok(parse_histogram(&String::from_utf8_lossy(&body), name))
}

/// `(upper bound, cumulative count)` of histogram `name` in a Prometheus text exposition,
/// summed over its label sets, by ascending bound.
fn parse_histogram(text: &str, name: &str) -> Vec<(f64, u64)> {
    let mut buckets: Vec<(f64, u64)> = Vec::new();
    for line in text.lines() {
        let Some(rest) = line
            .strip_prefix(name)
            .and_then(|r| r.strip_prefix("_bucket{"))
        else {
            continue;
        };
        // `le` is the last label; label values before it may hold commas or braces.
        let Some((labels, count)) = rest.rsplit_once("} ") else {
            continue;
        };
        let Some(le) = labels
            .rsplit_once("le=\"")
            .and_then(|(_, le)| le.strip_suffix('"'))
        else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            match le.parse() {
                Ok(le) => le,
                Err(_) => continue,
            }
        };
        let Ok(count) = count.trim().parse::<u64>() else {
            continue;
        };
        match buckets.iter_mut().find(|b| b.0 == le) {
            Some(bucket) => bucket.1 += count,
            None => buckets.push((le, count)),
        }
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    buckets
}

/// The upper bound of the bucket holding quantile `q` (NaN without observations).
pub fn quantile_bound(buckets: &[(f64, u64)], q: f64) -> f64 {
    let total = buckets.last().map_or(0, |b| b.1);
    if total == 0 {
        return f64::NAN;
    }
    let want = (total as f64 * q).ceil() as u64;
    buckets
        .iter()
        .find(|b| b.1 >= want)
        .map_or(f64::NAN, |b| b.0)
}

/// The fraction of observations at or below `bound` seconds (a bucket bound), NaN without any.
pub fn fraction_within(buckets: &[(f64, u64)], bound: f64) -> f64 {
    let total = buckets.last().map_or(0, |b| b.1);
    if total == 0 {
        return f64::NAN;
    }
    let within = buckets
        .iter()
        .take_while(|b| b.0 <= bound)
        .last()
        .map_or(0, |b| b.1);
    within as f64 / total as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_are_read_by_content_length() {
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(parse(&ok[..ok.len() - 1]).ok(), Some(None));
        let parsed = parse(ok).ok().flatten().expect("a complete response");
        assert_eq!(
            (parsed.status, &ok[parsed.body_start..parsed.end]),
            (200, &b"{}"[..])
        );
        assert_eq!(parse(b"HTTP/1.1 200 OK\r\ncontent-len").ok(), Some(None));
        assert!(parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n").is_err());
        assert!(parse(b"HTTP/1.1 200 OK\r\n\r\n").is_err());
        let empty = parse(b"HTTP/1.1 204 No Content\r\n\r\n")
            .ok()
            .flatten()
            .expect("a complete response");
        assert_eq!((empty.status, empty.end - empty.body_start), (204, 0));
    }

    #[test]
    fn histograms_are_read_across_label_sets_and_summarised_by_bucket_bounds() {
        let text = "\
# TYPE kvatlas_ingest_delay_seconds histogram
kvatlas_ingest_delay_seconds_bucket{model=\"a,b}\",tenant=\"t\",le=\"0.0005\"} 6
kvatlas_ingest_delay_seconds_bucket{model=\"a,b}\",tenant=\"t\",le=\"0.001\"} 9
kvatlas_ingest_delay_seconds_bucket{model=\"a,b}\",tenant=\"t\",le=\"+Inf\"} 10
kvatlas_ingest_delay_seconds_bucket{model=\"c\",tenant=\"t\",le=\"0.0005\"} 0
kvatlas_ingest_delay_seconds_bucket{model=\"c\",tenant=\"t\",le=\"0.001\"} 0
kvatlas_ingest_delay_seconds_bucket{model=\"c\",tenant=\"t\",le=\"+Inf\"} 10
kvatlas_ingest_delay_seconds_sum{model=\"c\",tenant=\"t\"} 3.5
kvatlas_log_lag_seconds_bucket{le=\"0.001\"} 99
";
        let buckets = parse_histogram(text, "kvatlas_ingest_delay_seconds");
        assert_eq!(buckets, vec![(0.0005, 6), (0.001, 9), (f64::INFINITY, 20)]);
        assert_eq!(quantile_bound(&buckets, 0.3), 0.0005);
        assert_eq!(quantile_bound(&buckets, 0.45), 0.001);
        assert_eq!(quantile_bound(&buckets, 0.99), f64::INFINITY);
        assert_eq!(fraction_within(&buckets, 1e-3), 9.0 / 20.0);
        assert_eq!(fraction_within(&buckets, 1e-4), 0.0);
        assert!(quantile_bound(&[], 0.5).is_nan());
        assert_eq!(
            parse_histogram(text, "kvatlas_log_lag_seconds"),
            vec![(0.001, 99)]
        );
    }
}
