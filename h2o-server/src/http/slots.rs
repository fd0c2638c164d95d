//! llama-server's slot save and restore: `POST /slots/{id}?action=save|restore|erase`, the
//! files in `--slot-save-path`. A saved slot keeps its tokens, KV cells and H2O state (scores,
//! memory sets, chunk bookkeeping), so that a restored slot serves the next request of its
//! conversation as the saved one would have.

use axum::extract::{Path, State};
use axum::http::Uri;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::Shared;
use crate::body::Body;
use crate::engine::{SlotOp, SlotOpError};
use crate::error::ApiError;

/// The body of a save or a restore.
#[derive(Debug, Deserialize)]
pub struct SlotFile {
    pub filename: String,
}

impl Body for SlotFile {}

/// The `action` of the query string.
fn action_of(uri: &Uri) -> Option<String> {
    uri.query()?
        .split('&')
        .find_map(|kv| kv.strip_prefix("action="))
        .map(str::to_string)
}

/// A file name inside `--slot-save-path`: no directories, nothing hidden.
fn check_filename(name: &str) -> Result<(), ApiError> {
    let bad = name.is_empty()
        || name.len() > 255
        || name.starts_with('.')
        || name.contains(['/', '\\', '\0'])
        || name.contains("..");
    if bad {
        return Err(ApiError::field(
            "filename",
            format!(
                "filename {name:?} is not a plain file name: give a name without directories \
                 (the file goes into --slot-save-path)"
            ),
        ));
    }
    Ok(())
}

pub async fn action(
    State(state): State<Shared>,
    Path(id): Path<String>,
    uri: Uri,
    body: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    let id: u32 = id.parse().map_err(|_| {
        ApiError::invalid(
            None,
            format!("slot id {id:?} is not a number: use GET /slots"),
        )
    })?;
    let action = action_of(&uri).ok_or_else(|| {
        ApiError::invalid(
            None,
            "no action: use ?action=save, ?action=restore or ?action=erase",
        )
    })?;
    let file = |dir: &std::path::Path| -> Result<(String, std::path::PathBuf), ApiError> {
        let f: SlotFile = super::parse_json(&body)?;
        check_filename(&f.filename)?;
        let path = dir.join(&f.filename);
        Ok((f.filename, path))
    };
    let dir = || {
        state.options.slot_save_path.clone().ok_or_else(|| {
            ApiError::not_supported(
                "this server saves no slots: start it with --slot-save-path DIR",
            )
        })
    };
    let (op, filename) = match action.as_str() {
        "save" => {
            let (name, path) = file(&dir()?)?;
            (SlotOp::Save(path), Some(name))
        }
        "restore" => {
            let (name, path) = file(&dir()?)?;
            if !path.is_file() {
                return Err(ApiError::field(
                    "filename",
                    format!("no saved slot {name:?} in --slot-save-path"),
                ));
            }
            (SlotOp::Restore(path), Some(name))
        }
        "erase" => (SlotOp::Erase, None),
        other => {
            return Err(ApiError::invalid(
                None,
                format!("action {other:?} is not one of save, restore, erase"),
            ))
        }
    };
    let done = state.engine.slot_op(id, op).await.map_err(|e| match e {
        SlotOpError::NoSuchSlot { .. } | SlotOpError::Busy(_) | SlotOpError::Failed(_) => {
            ApiError::invalid(None, e.to_string())
        }
        SlotOpError::ShuttingDown => crate::engine::SubmitError::ShuttingDown.into(),
    })?;
    Ok(Json(match action.as_str() {
        "save" => json!({
            "id_slot": id, "filename": filename, "n_saved": done.n_tokens,
            "n_written": done.n_bytes, "timings": { "save_ms": done.ms },
        }),
        "restore" => json!({
            "id_slot": id, "filename": filename, "n_restored": done.n_tokens,
            "n_read": done.n_bytes, "verified": !done.unverified,
            "timings": { "restore_ms": done.ms },
        }),
        _ => json!({ "id_slot": id, "n_erased": done.n_tokens }),
    }))
}
