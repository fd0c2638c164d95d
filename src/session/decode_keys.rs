//! The keys sparse decode steps read, as llama.cpp counted them.

use std::ptr::NonNull;

use super::config::H2oConfig;
use crate::sys;

/// The keys a query head read per sparse decode step since a sequence's last prompt call, as
/// llama.cpp counted them (`llama_h2o_decode_keys`). With `decode_coverage` below 1 a step's
/// count follows its attention, so [`H2oConfig::decode_keys`] is only its cap; with the whole
/// budget that count is exact and nothing is read back (which on a GPU costs a copy per layer).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct DecodeKeys {
    sum: f64,
    steps: u64,
}

impl DecodeKeys {
    /// Books a call of `n_tokens` tokens of sequence `seq` that left it `visible` positions: a
    /// prompt call (more than one token) starts the count again, and a decode step adds what it
    /// read (all `visible` positions when it ran llama.cpp's attention).
    pub(crate) fn record(
        &mut self,
        ctx: NonNull<sys::llama_context>,
        seq: i32,
        n_tokens: usize,
        visible: u32,
        h2o: Option<H2oConfig>,
    ) {
        if !h2o.is_some_and(|h| h.decode_budget > 0 && h.decode_coverage < 1.0) {
            return;
        }
        if n_tokens > 1 {
            *self = Self::default();
            return;
        }
        #[cfg(not(feature = "stock"))]
        // SAFETY: valid context; llama.cpp checks the sequence id.
        let keys = unsafe { sys::llama_h2o_decode_keys(ctx.as_ptr(), seq) };
        #[cfg(feature = "stock")]
        let keys = {
            let _ = (ctx, seq);
            -1.0_f32
        };
        self.sum += if keys >= 0.0 {
            f64::from(keys)
        } else {
            f64::from(visible)
        };
        self.steps += 1;
    }

    /// The keys a step read over the steps seeing `first ..= last` positions: the mean of those
    /// booked, or, where none was (the count is kept only when it follows the attention),
    /// [`H2oConfig::mean_decode_keys`] of `h2o`, which is then exact.
    pub(crate) fn per_step(&self, h2o: Option<H2oConfig>, first: u32, last: u32) -> f64 {
        if self.steps > 0 {
            return self.sum / self.steps as f64;
        }
        h2o.unwrap_or_default().mean_decode_keys(first, last)
    }
}
