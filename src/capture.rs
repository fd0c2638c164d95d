//! Capture of the H2O attention op's inputs and output through llama.cpp's eval callback, so that
//! the engine's prefill can be recomputed by the plain-Rust reference (`h2o_research::reference`) and compared, layer by layer.
//!
//! Turned on with [`crate::SessionConfig::capture_attention`]; every `llama_decode` call that
//! runs the sparse prefill then leaves one [`AttentionCapture`] per layer, taken with
//! [`crate::Session::take_attention_captures`]. It copies whole K/V caches per layer and call, so
//! it is a verification tool for short prompts, not something to leave on.
// The stock engine has no H2O op to read: only the types remain there.
#![cfg_attr(feature = "stock", allow(dead_code, unused_imports))]

use std::ffi::{c_void, CStr};
use std::sync::Mutex;

use crate::sys;

/// The H2O attention op of one layer in one `llama_decode` call, as the engine ran it.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionCapture {
    /// Model layer (from the op's graph name `h2o_attn-<layer>`).
    pub layer: u32,
    /// First position of the call's tokens.
    pub p0: u32,
    pub n_tokens: u32,
    /// S, L, H and the logit scale the op ran with.
    pub chunk: u32,
    pub local: u32,
    pub heavy: u32,
    pub scale: f32,
    /// The selection the op ran with (`ggml_h2o_select`: 0 = seed, 3 = hybrid, 4 = coverage; 1
    /// and 2 were retired policies), its sink, and the first position of the dense tail
    /// (`i32::MAX`: none).
    pub select: u32,
    pub sink: u32,
    pub tail_start: i32,
    /// The attention logit soft-cap (0: none) and the learned attention sink of every query
    /// head (empty: none) the op ran with (`ggml_h2o_attn_set_logits`).
    pub softcap: f32,
    pub sinks: Vec<f32>,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub head_dim: u32,
    pub head_dim_v: u32,
    /// Q of the call's tokens, `[n_tokens][n_head][head_dim]`, F32 as the op received it.
    pub q: Vec<f32>,
    /// K of cache positions `0 .. p0 + n_tokens`, `[position][n_head_kv][head_dim]`: the cache's
    /// values as F32 (F16 and BF16 widened exactly, a quantized cache dequantized as ggml does).
    pub k: Vec<f32>,
    /// V likewise, `[position][n_head_kv][head_dim_v]`.
    pub v: Vec<f32>,
    /// The op's output, `[n_tokens][n_head][head_dim_v]`.
    pub output: Vec<f32>,
}

/// The H2O sparse decode op of one layer in one decode step of one sequence, as the engine ran
/// it (`ggml_h2o_decode`): the query, the cache up to it, and the output.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeCapture {
    /// Model layer (from the op's graph name `h2o_decode-<layer>`).
    pub layer: u32,
    /// Positions the step sees (its own included): the cache's open cells.
    pub n: u32,
    /// The step's sink, recent window and budget (positions; the sink and budget of its
    /// sequence, which may be its own: see `ParallelSession::start_prompt`), and the logit scale.
    pub sink: u32,
    pub local: u32,
    pub budget: u32,
    pub scale: f32,
    /// The share of the candidates' estimated attention a step's choice holds (1: the budget;
    /// `ggml_h2o_decode_set_coverage`).
    pub coverage: f32,
    /// The positions a query head read in the step, the mean over the KV heads, as the op
    /// counted them (`ggml_h2o_decode_set_keys_read`; `None` where the graph asked for none).
    pub keys_read: Option<f32>,
    /// As [`AttentionCapture::softcap`] and [`AttentionCapture::sinks`].
    pub softcap: f32,
    pub sinks: Vec<f32>,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub head_dim: u32,
    pub head_dim_v: u32,
    /// Q of the step's token, `[n_head][head_dim]`.
    pub q: Vec<f32>,
    /// K and V of positions `0 .. n`, `[position][n_head_kv][head_dim(_v)]`, as F32.
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// The channels of each KV head's key sketch, `[n_head_kv][head_dim / 4]`, ascending, and
    /// the blocks sketched after the step (the state the op keeps with the cache).
    pub sketch_channels: Vec<u32>,
    pub sketched_blocks: u32,
    /// The op's output, `[n_head][head_dim_v]`.
    pub output: Vec<f32>,
}

/// What the callback fills; owned (boxed, so its address is stable) by the session.
#[derive(Debug, Default)]
pub(crate) struct CaptureSink {
    captures: Mutex<CaptureLog>,
    /// Only these model layers are copied (`None`: all); see `Session::capture_only_layers`.
    layers: Mutex<Option<Vec<u32>>>,
}

#[derive(Debug, Default)]
struct CaptureLog {
    captures: Vec<AttentionCapture>,
    decode: Vec<DecodeCapture>,
    /// The first thing the callback could not read, reported by `take` instead of panicking
    /// across the FFI boundary.
    error: Option<String>,
}

impl CaptureSink {
    pub(crate) fn take(&self) -> Result<Vec<AttentionCapture>, String> {
        self.take_from(|log| &mut log.captures)
    }

    pub(crate) fn take_decode(&self) -> Result<Vec<DecodeCapture>, String> {
        self.take_from(|log| &mut log.decode)
    }

    /// What one list of the log holds, emptied; or the callback's first error, which empties
    /// that list instead.
    fn take_from<T>(
        &self,
        list: impl FnOnce(&mut CaptureLog) -> &mut Vec<T>,
    ) -> Result<Vec<T>, String> {
        let mut log = self.captures.lock().unwrap_or_else(|e| e.into_inner());
        let error = log.error.take();
        let taken = std::mem::take(list(&mut log));
        match error {
            Some(e) => Err(e),
            None => Ok(taken),
        }
    }

    pub(crate) fn set_layers(&self, layers: Option<Vec<u32>>) {
        *self.layers.lock().unwrap_or_else(|e| e.into_inner()) = layers;
    }

    fn wants(&self, layer: Option<u32>) -> bool {
        let layers = self.layers.lock().unwrap_or_else(|e| e.into_inner());
        match (&*layers, layer) {
            (None, _) => true,
            (Some(list), Some(l)) => list.contains(&l),
            // a node whose name says no layer is read, so that read_h2o_node reports it
            (Some(_), None) => true,
        }
    }

    pub(crate) fn clear(&self) {
        let mut log = self.captures.lock().unwrap_or_else(|e| e.into_inner());
        *log = CaptureLog::default();
    }
}

/// `ggml_backend_sched_eval_callback`: asks for every H2O attention node and copies it out once
/// it has been computed. Always lets the computation continue.
#[cfg(not(feature = "stock"))]
pub(crate) unsafe extern "C" fn eval_callback(
    t: *mut sys::ggml_tensor,
    ask: bool,
    user_data: *mut c_void,
) -> bool {
    // SAFETY: llama.cpp passes a valid node; user_data is the session's boxed sink, alive for
    // as long as the context.
    let (t, sink) = unsafe { (&*t, &*(user_data as *const CaptureSink)) };
    if t.op != sys::GGML_OP_H2O_ATTN && t.op != sys::GGML_OP_H2O_DECODE {
        return !ask;
    }
    if ask {
        return sink.wants(node_layer(t));
    }
    // A panic must not unwind into C: turn it into the sink's error.
    let read = std::panic::catch_unwind(|| {
        // SAFETY: the node has just been computed and its sources are alive until the scheduler
        // moves on.
        unsafe {
            if t.op == sys::GGML_OP_H2O_DECODE {
                read_decode_node(t).map(Captured::Decode)
            } else {
                read_h2o_node(t).map(Captured::Prefill)
            }
        }
    });
    let mut log = sink.captures.lock().unwrap_or_else(|e| e.into_inner());
    match read {
        Ok(Ok(Captured::Prefill(c))) => log.captures.push(c),
        Ok(Ok(Captured::Decode(c))) => log.decode.push(c),
        Ok(Err(e)) => {
            log.error.get_or_insert(e);
        }
        Err(_) => {
            log.error
                .get_or_insert("panic while reading an H2O node".into());
        }
    }
    true
}

#[cfg(not(feature = "stock"))]
enum Captured {
    Prefill(AttentionCapture),
    Decode(DecodeCapture),
}

/// The model layer of an H2O node, from its graph name `h2o_attn-<layer>` or
/// `h2o_decode-<layer>`.
#[cfg(not(feature = "stock"))]
fn node_layer(t: &sys::ggml_tensor) -> Option<u32> {
    // SAFETY: ggml names are NUL-terminated within their array.
    let name = unsafe { CStr::from_ptr(t.name.as_ptr()) }.to_string_lossy();
    name.strip_prefix("h2o_attn-")
        .or_else(|| name.strip_prefix("h2o_decode-"))?
        .parse()
        .ok()
}

/// Copies one `GGML_OP_H2O_DECODE` node of one sequence and one token (see `ggml_h2o_decode`
/// for its layout): its open cells are those of the mask's first row.
#[cfg(not(feature = "stock"))]
unsafe fn read_decode_node(t: &sys::ggml_tensor) -> Result<DecodeCapture, String> {
    // SAFETY: the caller guarantees a computed node, so its sources are valid tensors.
    let (q, k, v, mask) = unsafe { (&*t.src[0], &*t.src[1], &*t.src[2], &*t.src[5]) };
    let layer = node_layer(t).ok_or("unexpected H2O decode node name")?;
    if q.ne[2] != 1 || q.ne[3] != 1 {
        return Err(format!(
            "layer {layer}: decode capture reads one sequence's one-token steps"
        ));
    }
    let n_kv = mask.ne[0] as usize;
    // the mask's first row: F32, or F16 whose -inf is 0xFC00
    let open: Vec<bool> = match mask.type_ {
        sys::GGML_TYPE_F32 => {
            // SAFETY: the row lies inside the mask.
            let row = unsafe { read_rows_f32(mask, n_kv, 1, 1) };
            row.iter().map(|&m| m != f32::NEG_INFINITY).collect()
        }
        sys::GGML_TYPE_F16 => {
            let mut raw = vec![0u16; n_kv];
            // SAFETY: as above, n_kv F16 values.
            unsafe { sys::ggml_backend_tensor_get(mask, raw.as_mut_ptr().cast(), 0, n_kv * 2) };
            raw.iter().map(|&m| m != 0xFC00).collect()
        }
        _ => return Err(format!("layer {layer}: unexpected mask type")),
    };
    let n = open.iter().rposition(|&o| o).map_or(0, |i| i + 1);
    let (d, n_head, n_head_kv, dv) = (
        q.ne[0] as usize,
        q.ne[1] as usize,
        k.ne[1] as usize,
        v.ne[0] as usize,
    );
    let p = &t.op_params;
    // SAFETY (all four): shapes and strides come from the tensors themselves.
    let qv = unsafe { read_rows_f32(q, d, n_head, 1) };
    let kv = unsafe { read_rows(k, d, n_head_kv, n) }?;
    let vv = unsafe { read_rows(v, dv, n_head_kv, n) }?;
    let out = unsafe { read_rows_f32(t, dv, n_head, 1) };
    // SAFETY: as above.
    let sinks = unsafe { read_sinks(t, n_head) };
    // the sketch state, I32 [3 + n_head_kv * head_dim / 4] for the step's one stream: blocks
    // sketched, the channels, the stream's own sink and budget (-1: the op's)
    // SAFETY: a computed node's sources are valid.
    let state = unsafe { &*t.src[4] };
    let mut sketch = vec![0i32; 3 + n_head_kv * (d / 4)];
    if state.type_ != sys::GGML_TYPE_I32 || state.ne[0] as usize != sketch.len() {
        return Err(format!("layer {layer}: unexpected sketch state"));
    }
    // SAFETY: the row lies inside the tensor (checked above).
    unsafe { sys::ggml_backend_tensor_get(state, sketch.as_mut_ptr().cast(), 0, sketch.len() * 4) };
    // the positions read, F32 [n_stream] (one stream here), where the graph asked for them
    let keys_read = if t.src[7].is_null() {
        None
    } else {
        // SAFETY: a computed node's sources are valid tensors.
        let keys = unsafe { &*t.src[7] };
        if keys.type_ != sys::GGML_TYPE_F32 || keys.ne[0] < 1 {
            return Err(format!("layer {layer}: unexpected count of positions read"));
        }
        let mut n = 0.0_f32;
        // SAFETY: one F32 value inside the tensor (checked above).
        unsafe { sys::ggml_backend_tensor_get(keys, (&raw mut n).cast(), 0, 4) };
        Some(n)
    };
    Ok(DecodeCapture {
        layer,
        n: n as u32,
        sink: match sketch[sketch.len() - 2] {
            own if own >= 0 => own as u32,
            _ => i32_at(p, sys::GGML_H2O_DECODE_SINK) as u32,
        },
        local: i32_at(p, sys::GGML_H2O_DECODE_LOCAL) as u32,
        budget: match sketch[sketch.len() - 1] {
            own if own >= 0 => own as u32,
            _ => i32_at(p, sys::GGML_H2O_DECODE_BUDGET) as u32,
        },
        scale: f32_at(p, sys::GGML_H2O_DECODE_SCALE),
        coverage: f32_at(p, sys::GGML_H2O_DECODE_COVERAGE),
        keys_read,
        softcap: f32_at(p, sys::GGML_H2O_DECODE_SOFTCAP),
        sinks,
        n_head: n_head as u32,
        n_head_kv: n_head_kv as u32,
        head_dim: d as u32,
        head_dim_v: dv as u32,
        q: qv,
        k: kv,
        v: vv,
        sketch_channels: sketch[1..sketch.len() - 2]
            .iter()
            .map(|&c| c as u32)
            .collect(),
        sketched_blocks: sketch[0] as u32,
        output: out,
    })
}

/// Copies one `GGML_OP_H2O_ATTN` node (see `ggml_h2o_attn` for its layout).
#[cfg(not(feature = "stock"))]
unsafe fn read_h2o_node(t: &sys::ggml_tensor) -> Result<AttentionCapture, String> {
    // SAFETY: the caller guarantees a computed node, so its sources are valid tensors.
    let (q, k, v) = unsafe { (&*t.src[0], &*t.src[1], &*t.src[2]) };
    let layer = node_layer(t).ok_or_else(|| {
        // SAFETY: ggml names are NUL-terminated within their array.
        let name = unsafe { CStr::from_ptr(t.name.as_ptr()) }.to_string_lossy();
        format!("unexpected H2O node name {name:?}")
    })?;
    if q.type_ != sys::GGML_TYPE_F32 || t.type_ != sys::GGML_TYPE_F32 {
        return Err(format!("layer {layer}: unexpected H2O tensor types"));
    }
    let p = &t.op_params;
    let (p0, n_tokens) = (i32_at(p, sys::GGML_H2O_ATTN_P0) as usize, q.ne[2] as usize);
    let n_pos = p0 + n_tokens;
    if n_pos as i64 > k.ne[2] {
        return Err(format!("layer {layer}: positions beyond the K view"));
    }
    let (d, n_head, n_head_kv, dv) = (
        q.ne[0] as usize,
        q.ne[1] as usize,
        k.ne[1] as usize,
        v.ne[0] as usize,
    );
    // SAFETY (all four): shapes and strides come from the tensors themselves.
    let qv = unsafe { read_rows_f32(q, d, n_head, n_tokens) };
    let kv = unsafe { read_rows(k, d, n_head_kv, n_pos) }?;
    let vv = unsafe { read_rows(v, dv, n_head_kv, n_pos) }?;
    let out = unsafe { read_rows_f32(t, dv, n_head, n_tokens) };
    // SAFETY: a computed node's sources are valid.
    let sinks = unsafe { read_sinks(t, n_head) };
    Ok(AttentionCapture {
        layer,
        p0: p0 as u32,
        n_tokens: n_tokens as u32,
        chunk: i32_at(p, sys::GGML_H2O_ATTN_CHUNK) as u32,
        local: i32_at(p, sys::GGML_H2O_ATTN_LOCAL) as u32,
        heavy: i32_at(p, sys::GGML_H2O_ATTN_HEAVY) as u32,
        scale: f32_at(p, sys::GGML_H2O_ATTN_SCALE),
        select: i32_at(p, sys::GGML_H2O_ATTN_SELECT) as u32,
        sink: i32_at(p, sys::GGML_H2O_ATTN_SINK) as u32,
        tail_start: i32_at(p, sys::GGML_H2O_ATTN_TAIL_START),
        softcap: f32_at(p, sys::GGML_H2O_ATTN_SOFTCAP),
        sinks,
        n_head: n_head as u32,
        n_head_kv: n_head_kv as u32,
        head_dim: d as u32,
        head_dim_v: dv as u32,
        q: qv,
        k: kv,
        v: vv,
        output: out,
    })
}

/// An H2O op's integer parameter in `slot` (`ggml_h2o_attn_param`, `ggml_h2o_decode_param`).
#[cfg(not(feature = "stock"))]
fn i32_at(op_params: &[i32], slot: u32) -> i32 {
    op_params[slot as usize]
}

/// An H2O op's float parameter in `slot`, as ggml stores it (the bits in an i32 slot).
#[cfg(not(feature = "stock"))]
fn f32_at(op_params: &[i32], slot: u32) -> f32 {
    f32::from_bits(op_params[slot as usize] as u32)
}

/// The learned attention sink of every query head an H2O op ran with (empty: none).
///
/// # Safety
/// `t` is a computed H2O node, whose `src[6]` is null or F32 `[n_head]`
/// (`ggml_h2o_attn_set_logits`).
#[cfg(not(feature = "stock"))]
unsafe fn read_sinks(t: &sys::ggml_tensor, n_head: usize) -> Vec<f32> {
    match t.src[6].is_null() {
        true => Vec::new(),
        // SAFETY: the caller's promise.
        false => unsafe { read_rows_f32(&*t.src[6], n_head, 1, 1) },
    }
}

/// Byte offsets of rows `[i2][i1]` (each `ne0` elements long) of a 3-d tensor.
fn row_offsets(t: &sys::ggml_tensor, n1: usize, n2: usize) -> impl Iterator<Item = usize> + '_ {
    (0..n2).flat_map(move |i2| (0..n1).map(move |i1| i2 * t.nb[2] + i1 * t.nb[1]))
}

/// # Safety
/// `t` is a computed F32 tensor with at least `ne0 × n1 × n2` elements along dims 0–2.
#[cfg(not(feature = "stock"))]
unsafe fn read_rows_f32(t: &sys::ggml_tensor, ne0: usize, n1: usize, n2: usize) -> Vec<f32> {
    let mut out = vec![0f32; ne0 * n1 * n2];
    for (row, off) in out.chunks_exact_mut(ne0).zip(row_offsets(t, n1, n2)) {
        // SAFETY: the row lies inside the tensor (caller); ggml copies from any backend.
        unsafe {
            sys::ggml_backend_tensor_get(t, row.as_mut_ptr().cast(), off, ne0 * 4);
        }
    }
    out
}

/// # Safety
/// As [`read_rows_f32`], for a tensor of F32 or of any type ggml converts to F32 (F16, BF16
/// widened exactly; quantized types dequantized), whose rows are whole blocks.
#[cfg(not(feature = "stock"))]
unsafe fn read_rows(
    t: &sys::ggml_tensor,
    ne0: usize,
    n1: usize,
    n2: usize,
) -> Result<Vec<f32>, String> {
    if t.type_ == sys::GGML_TYPE_F32 {
        // SAFETY: the caller's promise, for an F32 tensor (ggml has no conversion for it)
        return Ok(unsafe { read_rows_f32(t, ne0, n1, n2) });
    }
    // SAFETY: ggml's type traits are static tables, valid for every type.
    let traits = unsafe { &*sys::ggml_get_type_traits(t.type_) };
    let to_float = traits.to_float.ok_or_else(|| {
        // SAFETY: type_name is a static C string of the traits table.
        let name = unsafe { std::ffi::CStr::from_ptr(traits.type_name) };
        format!(
            "ggml cannot convert a tensor of type {} to F32",
            name.to_string_lossy()
        )
    })?;
    // SAFETY: a pure function of a valid type and a count.
    let row_bytes = unsafe { sys::ggml_row_size(t.type_, ne0 as i64) };
    let mut raw = vec![0u8; row_bytes];
    let mut out = vec![0f32; ne0 * n1 * n2];
    for (row, off) in out.chunks_exact_mut(ne0).zip(row_offsets(t, n1, n2)) {
        // SAFETY: as above; `raw` holds one row of the tensor's type, `row` its ne0 values.
        unsafe {
            sys::ggml_backend_tensor_get(t, raw.as_mut_ptr().cast(), off, row_bytes);
            to_float(raw.as_ptr().cast(), row.as_mut_ptr(), ne0 as i64);
        }
    }
    Ok(out)
}
