//! Reading what the eval callback captured of the H2O attention ops (see [`crate::capture`]), for
//! the layer-by-layer proof against [`crate::reference`].

use super::Session;
use crate::capture::AttentionCapture;
use crate::error::{Error, Result};

impl Session<'_> {
    /// The H2O attention ops run since the last call, one [`AttentionCapture`] per layer and
    /// `llama_decode` call, in the order they ran.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the session was created without
    /// [`SessionConfig::capture_attention`](crate::SessionConfig::capture_attention); [`Error::Capture`] when a node could not be read.
    pub fn take_attention_captures(&mut self) -> Result<Vec<AttentionCapture>> {
        let sink = self.capture.as_ref().ok_or_else(|| {
            Error::InvalidConfig(
                "attention capture is off: create the session with capture_attention = true".into(),
            )
        })?;
        sink.take().map_err(Error::Capture)
    }
}
