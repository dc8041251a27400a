//! Fuzz target: any bytes as a kvatlas.v1 request, a peer's answer, a Dynamo route's JSON body or
//! llm-d's `GetPodScores`, or a NATS event-log message (the first byte picks Query,
//! RegisterWorker, PublishEvents, a native snapshot, a Dynamo `/dump`, a Dynamo route,
//! GetPodScores, an event-log message) through the server's validation,
//! conversion and index work, without a network (`kvatlas_server::fuzzing`). Must never panic,
//! never answer INTERNAL, and stay within the small server's bounds (ASan and `-rss_limit_mb`
//! catch unbounded allocation).

#![no_main]

use kvatlas_server::ServiceError;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(Err(ServiceError::Internal(message))) = kvatlas_server::fuzzing::request(data) {
        panic!("a request was answered INTERNAL: {message}");
    }
});
