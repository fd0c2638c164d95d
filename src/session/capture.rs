//! Reading what the eval callback captured of the H2O attention ops (see [`crate::capture`]), for
//! the layer-by-layer proof against the plain-Rust reference (`h2o_research::reference`).

use super::Session;
use crate::capture::{AttentionCapture, CaptureSink, DecodeCapture};
use crate::error::{Error, Result};

impl Session<'_> {
    /// The H2O attention ops run since the last call, one [`AttentionCapture`] per layer and
    /// `llama_decode` call, in the order they ran.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the session was created without
    /// [`SessionConfig::capture_attention`](crate::SessionConfig::capture_attention); [`Error::Capture`] when a node could not be read.
    pub fn take_attention_captures(&mut self) -> Result<Vec<AttentionCapture>> {
        let sink = self.capture_sink()?;
        sink.take().map_err(Error::Capture)
    }

    /// The H2O sparse decode ops run since the last call, one [`DecodeCapture`] per
    /// layer and decode step, in the order they ran.
    ///
    /// # Errors
    /// As [`Session::take_attention_captures`].
    pub fn take_decode_captures(&mut self) -> Result<Vec<DecodeCapture>> {
        let sink = self.capture_sink()?;
        sink.take_decode().map_err(Error::Capture)
    }

    /// Limits attention capture to these model layers (`None`: every layer), so that a long
    /// prompt's capture holds only what a study reads; takes effect from the next call.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the session was created without
    /// [`SessionConfig::capture_attention`](crate::SessionConfig::capture_attention).
    pub fn capture_only_layers(&mut self, layers: Option<Vec<u32>>) -> Result<()> {
        let sink = self.capture_sink()?;
        sink.set_layers(layers);
        Ok(())
    }

    fn capture_sink(&self) -> Result<&CaptureSink> {
        self.capture.as_deref().ok_or_else(|| {
            Error::InvalidConfig(
                "attention capture is off: create the session with capture_attention = true".into(),
            )
        })
    }
}
