//! Host calls that report every status as a `Result`.
//!
//! The SDK's `hostcalls::*` return `Result` but still `panic!` on statuses they do not expect
//! (for example `get_buffer` on `BadArgument`, `get_map` outside its phase), and a panic kills
//! the worker's VM. These wrappers call the same proxy-wasm ABI 0.2.1 imports and return the
//! raw status instead. Only `dispatch_http_call` stays with the SDK: it must register the
//! callout token with the SDK's dispatcher.

#![allow(clashing_extern_declarations)]

use filter_core::hostmap::{deserialize_map, serialize_map};
use std::ptr::{null, null_mut};

/// A non-Ok proxy-wasm status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostError(pub u32);

impl std::fmt::Display for HostError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self.0 {
            1 => "NotFound",
            2 => "BadArgument",
            3 => "SerializationFailure",
            4 => "ParseFailure",
            7 => "Empty",
            8 => "CasMismatch",
            10 => "InternalFailure",
            12 => "Unimplemented",
            _ => "status",
        };
        write!(f, "{name} ({})", self.0)
    }
}

type R<T> = Result<T, HostError>;

fn ok(status: u32) -> R<()> {
    if status == 0 {
        Ok(())
    } else {
        Err(HostError(status))
    }
}

pub const MAP_REQUEST_HEADERS: u32 = 0;
pub const MAP_RESPONSE_HEADERS: u32 = 2;
pub const MAP_HTTP_CALL_RESPONSE_HEADERS: u32 = 6;
pub const BUFFER_REQUEST_BODY: u32 = 0;
pub const BUFFER_RESPONSE_BODY: u32 = 1;
pub const BUFFER_HTTP_CALL_RESPONSE_BODY: u32 = 4;
pub const BUFFER_PLUGIN_CONFIGURATION: u32 = 7;
const STREAM_REQUEST: u32 = 0;
const STREAM_RESPONSE: u32 = 1;
const METRIC_COUNTER: u32 = 0;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Debug = 1,
    Info = 2,
    Warn = 3,
    Error = 4,
    Critical = 5,
}

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: u32, message_data: *const u8, message_size: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        return_data: *mut *mut u8,
        return_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_pairs(
        map_type: u32,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map_type: u32, key_data: *const u8, key_size: usize) -> u32;
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_define_metric(
        metric_type: u32,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
    fn proxy_register_shared_queue(
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_enqueue_shared_queue(queue_id: u32, value_data: *const u8, value_size: usize) -> u32;
    fn proxy_dequeue_shared_queue(
        queue_id: u32,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
}

/// Takes ownership of host-allocated memory (allocated through the SDK's exported
/// `proxy_on_memory_allocate`, i.e. the Rust global allocator, as the SDK itself assumes).
fn take(data: *mut u8, size: usize) -> Option<Vec<u8>> {
    if data.is_null() {
        None
    } else {
        // SAFETY: the host wrote `size` bytes into a block of exactly `size` bytes that it
        // obtained from `proxy_on_memory_allocate(size)`; we are its only owner.
        Some(unsafe { Vec::from_raw_parts(data, size, size) })
    }
}

pub fn log(level: Level, message: &str) {
    // SAFETY: pointer and length of a live str.
    unsafe {
        proxy_log(level as u32, message.as_ptr(), message.len());
    }
}

pub fn now_ms() -> R<u64> {
    Ok(now_ns()? / 1_000_000)
}

#[link(wasm_import_module = "wasi_snapshot_preview1")]
extern "C" {
    fn clock_time_get(clock_id: u32, precision: u64, time: *mut u64) -> u16;
}

/// The host's monotonic clock, in ns (Envoy's steady clock, its dispatcher's: it never steps
/// with the wall clock). WASI's `clock_time_get`, called here so that an error is a `Result`
/// (std's `Instant::now()` would panic on one).
pub fn monotonic_ns() -> Result<u64, u16> {
    const MONOTONIC: u32 = 1;
    let mut t: u64 = 0;
    // SAFETY: valid out-pointer.
    match unsafe { clock_time_get(MONOTONIC, 1_000, &mut t) } {
        0 => Ok(t),
        errno => Err(errno),
    }
}

pub fn now_ns() -> R<u64> {
    let mut t: u64 = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { proxy_get_current_time_nanoseconds(&mut t) })?;
    Ok(t)
}

pub fn set_tick_period_ms(ms: u32) -> R<()> {
    // SAFETY: plain value.
    ok(unsafe { proxy_set_tick_period_milliseconds(ms) })
}

/// Up to `max` bytes of a buffer from `start`; `Ok(None)` when the host has no such buffer.
pub fn get_buffer(buffer_type: u32, start: usize, max: usize) -> R<Option<Vec<u8>>> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: valid out-pointers.
    let status = unsafe { proxy_get_buffer_bytes(buffer_type, start, max, &mut data, &mut size) };
    match status {
        0 => Ok(take(data, size)),
        1 => Ok(None),
        s => Err(HostError(s)),
    }
}

pub fn get_headers(map_type: u32) -> R<Vec<(String, String)>> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: valid out-pointers.
    ok(unsafe { proxy_get_header_map_pairs(map_type, &mut data, &mut size) })?;
    match take(data, size) {
        Some(bytes) => deserialize_map(&bytes).ok_or(HostError(3)),
        None => Ok(Vec::new()),
    }
}

pub fn replace_header(map_type: u32, name: &str, value: &str) -> R<()> {
    // SAFETY: pointers and lengths of live strs.
    ok(unsafe {
        proxy_replace_header_map_value(
            map_type,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        )
    })
}

pub fn remove_header(map_type: u32, name: &str) -> R<()> {
    // SAFETY: pointer and length of a live str.
    ok(unsafe { proxy_remove_header_map_value(map_type, name.as_ptr(), name.len()) })
}

/// A stream property (`["response", "code_details"]`): `Ok(None)` when absent.
pub fn get_property(path: &[&str]) -> R<Option<Vec<u8>>> {
    let mut serialized = Vec::new();
    for part in path {
        serialized.extend_from_slice(part.as_bytes());
        serialized.push(0);
    }
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: valid pointers.
    let status =
        unsafe { proxy_get_property(serialized.as_ptr(), serialized.len(), &mut data, &mut size) };
    match status {
        0 => Ok(take(data, size)),
        1 => Ok(None),
        s => Err(HostError(s)),
    }
}

/// Makes `context_id` the context that the following host calls act on.
pub fn set_effective_context(context_id: u32) -> R<()> {
    // SAFETY: plain value.
    ok(unsafe { proxy_set_effective_context(context_id) })
}

pub fn resume_request() -> R<()> {
    // SAFETY: plain value.
    ok(unsafe { proxy_continue_stream(STREAM_REQUEST) })
}

pub fn resume_response() -> R<()> {
    // SAFETY: plain value.
    ok(unsafe { proxy_continue_stream(STREAM_RESPONSE) })
}

/// `details` becomes the stream's response code details (no spaces).
pub fn send_response(
    status: u32,
    details: &str,
    headers: &[(String, String)],
    body: &[u8],
) -> R<()> {
    let serialized = serialize_map(headers);
    // SAFETY: pointers and lengths of live buffers.
    ok(unsafe {
        proxy_send_local_response(
            status,
            details.as_ptr(),
            details.len(),
            if body.is_empty() {
                null()
            } else {
                body.as_ptr()
            },
            body.len(),
            serialized.as_ptr(),
            serialized.len(),
            -1,
        )
    })
}

pub fn define_counter(name: &str) -> R<u32> {
    let mut id: u32 = 0;
    // SAFETY: valid pointers.
    ok(unsafe { proxy_define_metric(METRIC_COUNTER, name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

pub fn increment(id: u32) -> R<()> {
    // SAFETY: plain values.
    ok(unsafe { proxy_increment_metric(id, 1) })
}

/// Registers (or opens) a shared queue; its `on_queue_ready` goes to this thread's root context.
pub fn register_queue(name: &str) -> R<u32> {
    let mut id: u32 = 0;
    // SAFETY: valid pointers.
    ok(unsafe { proxy_register_shared_queue(name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

pub fn enqueue(queue_id: u32, value: &[u8]) -> R<()> {
    // SAFETY: pointer and length of a live slice.
    ok(unsafe { proxy_enqueue_shared_queue(queue_id, value.as_ptr(), value.len()) })
}

/// The next item of a queue; `Ok(None)` when it is empty.
pub fn dequeue(queue_id: u32) -> R<Option<Vec<u8>>> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: valid out-pointers.
    match unsafe { proxy_dequeue_shared_queue(queue_id, &mut data, &mut size) } {
        0 => Ok(Some(take(data, size).unwrap_or_default())),
        7 => Ok(None),
        s => Err(HostError(s)),
    }
}
