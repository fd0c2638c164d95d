//! Inspecting a session's H2O state: its shape and progress ([`H2oState`]), the memory set and
//! the accumulated scores of a layer and query head, as the engine stores them.

use super::Session;
use crate::error::{H2oError, Result};
#[cfg(not(feature = "stock"))]
use crate::sys;

/// The H2O state a session holds (see [`Session::h2o_state`]): its shape, its size and how far
/// the chunked prefill has got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct H2oState {
    /// L.
    pub local: u32,
    /// H.
    pub heavy: u32,
    /// M = L + H, the slots of a memory set.
    pub memory_size: u32,
    /// S = `n_ubatch`, positions per chunk.
    pub chunk_size: u32,
    /// Layers with H2O state: all of a dense model's, the non-SWA ones of a model with
    /// interleaved sliding-window layers ([`Session::h2o_layers`] says which).
    pub n_layer: u32,
    /// Query heads per layer; memory sets and scores are per query head.
    pub n_head: u32,
    /// Cache cells, which are the positions the scores cover.
    pub kv_size: u32,
    /// Chunks completed since the last reset.
    pub chunks_done: u32,
    /// Prompt positions in those chunks.
    pub tokens_done: u32,
    /// Chunks whose queries attended to a memory set, counted by llama.cpp as they run, since
    /// the sequence was last emptied (kept by cuts, carried by saved states).
    pub sparse_chunks: u32,
    /// Prompt positions that took the dense tail, counted likewise.
    pub tail_tokens: u32,
    /// Whether a memory set has been built since the last reset.
    pub memory_initialized: bool,
    /// Bytes of the score and memory-index tensors of all layers.
    pub size_bytes: u64,
}

impl H2oState {
    /// What llama.cpp counted between `before`, an earlier state of the same sequence, and this
    /// one: (sparse chunks, dense-tail tokens). All of this state's counts where there was no
    /// earlier state; none where the sequence was emptied in between.
    #[must_use]
    pub fn counts_since(&self, before: Option<&H2oState>) -> (u32, u32) {
        let (sparse, tail) = before.map_or((0, 0), |b| (b.sparse_chunks, b.tail_tokens));
        (
            self.sparse_chunks.saturating_sub(sparse),
            self.tail_tokens.saturating_sub(tail),
        )
    }
}

impl Session<'_> {
    /// The H2O state, or `None` when the session runs full attention.
    #[must_use]
    pub fn h2o_state(&self) -> Option<H2oState> {
        #[cfg(feature = "stock")]
        {
            None
        }
        #[cfg(not(feature = "stock"))]
        {
            // SAFETY: plain-data out parameter, valid context.
            let mut info: sys::llama_h2o_info = unsafe { std::mem::zeroed() };
            let rc = unsafe { sys::llama_h2o_get_info(self.ctx.as_ptr(), &mut info) };
            (rc == sys::LLAMA_H2O_STATUS_OK).then(|| state_from_info(&info))
        }
    }

    /// The memory set of `layer`, query `head`: the positions the next chunk attends to besides
    /// its own, as the engine stores them (ascending, unused slots −1).
    ///
    /// # Errors
    /// [`Error::H2o`](crate::Error::H2o): no H2O state, or `layer`/`head` out of range.
    pub fn h2o_memory_set(&self, layer: u32, head: u32) -> Result<super::MemorySet> {
        let state = self.h2o_state().ok_or(H2oError::Disabled)?;
        self.check_h2o_head(&state, layer, head)?;
        #[allow(unused_mut)] // filled by the FFI call, which stock builds lack
        let mut slots = vec![-1i32; state.memory_size as usize];
        #[cfg(not(feature = "stock"))]
        {
            // SAFETY: `slots` has room for the M values written; layer/head were checked.
            let rc = unsafe {
                sys::llama_h2o_get_memory_indices(
                    self.ctx.as_ptr(),
                    layer as i32,
                    head as i32,
                    slots.as_mut_ptr(),
                    slots.len(),
                )
            };
            h2o_status(rc, &state, layer, head, 0..0)?;
        }
        Ok(super::MemorySet { slots })
    }

    /// Accumulated attention scores of `layer`, query `head`, for `positions` (F32 values of the
    /// BF16 store).
    ///
    /// # Errors
    /// [`Error::H2o`](crate::Error::H2o): no H2O state, `layer`/`head` out of range, or positions outside the cache.
    pub fn h2o_scores(
        &self,
        layer: u32,
        head: u32,
        positions: std::ops::Range<u32>,
    ) -> Result<Vec<f32>> {
        let state = self.h2o_state().ok_or(H2oError::Disabled)?;
        self.check_h2o_head(&state, layer, head)?;
        if positions.start > positions.end || positions.end > state.kv_size {
            return Err(H2oError::InvalidRange {
                start: positions.start.into(),
                end: positions.end.into(),
                kv_size: state.kv_size,
            }
            .into());
        }
        #[allow(unused_mut)] // filled by the FFI call, which stock builds lack
        let mut scores = vec![0f32; positions.len()];
        #[cfg(not(feature = "stock"))]
        {
            // SAFETY: `scores` has room for the n values written; arguments were checked.
            let rc = unsafe {
                sys::llama_h2o_get_scores(
                    self.ctx.as_ptr(),
                    layer as i32,
                    head as i32,
                    positions.start as i32,
                    scores.len() as i32,
                    scores.as_mut_ptr(),
                )
            };
            h2o_status(rc, &state, layer, head, positions)?;
        }
        Ok(scores)
    }

    /// The model layers that hold H2O state, ascending: every layer of a dense model, the
    /// non-SWA (global) layers of a model with interleaved sliding-window layers such as Gemma 3.
    /// Empty when the session runs full attention.
    #[must_use]
    pub fn h2o_layers(&self) -> Vec<u32> {
        #[cfg(feature = "stock")]
        {
            Vec::new()
        }
        #[cfg(not(feature = "stock"))]
        {
            let Some(state) = self.h2o_state() else {
                return Vec::new();
            };
            let mut ids = vec![0i32; state.n_layer as usize];
            // SAFETY: `ids` has room for the n_layer values written.
            let rc = unsafe {
                sys::llama_h2o_get_layers(self.ctx.as_ptr(), ids.as_mut_ptr(), ids.len())
            };
            ids.truncate(rc.max(0) as usize);
            ids.into_iter().map(|il| il as u32).collect()
        }
    }

    fn check_h2o_head(&self, state: &H2oState, layer: u32, head: u32) -> Result<()> {
        if !self.h2o_layers().contains(&layer) {
            return Err(H2oError::InvalidLayer {
                layer,
                n_layer: state.n_layer,
            }
            .into());
        }
        if head >= state.n_head {
            return Err(H2oError::InvalidHead {
                head,
                n_head: state.n_head,
            }
            .into());
        }
        Ok(())
    }
}

/// Maps a `llama_h2o_*` return value (count or negative `llama_h2o_status`) to a typed error.
#[cfg(not(feature = "stock"))]
fn h2o_status(
    rc: i32,
    state: &H2oState,
    layer: u32,
    head: u32,
    positions: std::ops::Range<u32>,
) -> Result<()> {
    if rc >= 0 {
        return Ok(());
    }
    Err(match rc {
        sys::LLAMA_H2O_STATUS_DISABLED => H2oError::Disabled,
        sys::LLAMA_H2O_STATUS_INVALID_LAYER => H2oError::InvalidLayer {
            layer,
            n_layer: state.n_layer,
        },
        sys::LLAMA_H2O_STATUS_INVALID_HEAD => H2oError::InvalidHead {
            head,
            n_head: state.n_head,
        },
        sys::LLAMA_H2O_STATUS_INVALID_RANGE => H2oError::InvalidRange {
            start: positions.start.into(),
            end: positions.end.into(),
            kv_size: state.kv_size,
        },
        other => H2oError::Other(other),
    }
    .into())
}

/// [`H2oState`] from what `llama_h2o_get_info` / `llama_h2o_get_seq_info` filled in.
#[cfg(not(feature = "stock"))]
pub(super) fn state_from_info(info: &sys::llama_h2o_info) -> H2oState {
    H2oState {
        local: info.n_local as u32,
        heavy: info.n_heavy as u32,
        memory_size: info.n_memory as u32,
        chunk_size: info.n_chunk as u32,
        n_layer: info.n_layer as u32,
        n_head: info.n_head as u32,
        kv_size: info.kv_size as u32,
        chunks_done: info.n_chunks_done as u32,
        tokens_done: info.n_tokens_done as u32,
        sparse_chunks: info.n_sparse_chunks as u32,
        tail_tokens: info.n_tail_tokens as u32,
        memory_initialized: info.memory_initialized,
        size_bytes: info.size_bytes as u64,
    }
}
