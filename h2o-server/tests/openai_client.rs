//! h2o-server through OpenAI's own Python client: `tests/openai/client.py` (chat, streamed tool
//! calls, JSON schema output, `logit_bias`, logprobs, error objects) against a server on the
//! default model with `examples/templates/chatml-tools.jinja`. The `openai` package is
//! installed with pip into the target directory when python3 does not have it, as the default
//! model is fetched with pip.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::*;

/// The version the script was written against.
const OPENAI_PACKAGE: &str = "openai==3.57.0";

/// A `PYTHONPATH` under which `import openai` works (empty: python3's own has it).
fn openai_pythonpath() -> String {
    let has = |path: &str| {
        Command::new("python3")
            .args(["-c", "import openai"])
            .env("PYTHONPATH", path)
            .status()
            .is_ok_and(|s| s.success())
    };
    if has("") {
        return String::new();
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("openai-python");
    let dir_text = dir.display().to_string();
    if !has(&dir_text) {
        let out = Command::new("python3")
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--target",
            ])
            .arg(&dir)
            .arg(OPENAI_PACKAGE)
            .output()
            .expect("python3 runs (the default model needs it too)");
        assert!(
            out.status.success(),
            "pip install {OPENAI_PACKAGE} failed (no network access to PyPI?):\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            has(&dir_text),
            "{OPENAI_PACKAGE} installed but not importable"
        );
    }
    dir_text
}

#[test]
fn openais_python_client_gets_what_it_expects() {
    let _engine = common::one_engine_at_a_time();
    let pythonpath = openai_pythonpath();
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let template = manifest.join("../examples/templates/chatml-tools.jinja");
    let template = template.display().to_string();
    let server = Server::start(&["-c", "2048", "-np", "1", "--chat-template-file", &template]);
    let out = Command::new("python3")
        .arg(manifest.join("tests/openai/client.py"))
        .arg(server.url(""))
        .env("PYTHONPATH", &pythonpath)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("all checks passed"),
        "{stdout}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        server.log_text()
    );
}
