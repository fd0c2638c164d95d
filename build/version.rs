//! The generated version headers (`llama-version.h`, `ggml-version.h`) that upstream's CMake
//! would write, with the versions read from its CMakeLists; and `write_if_changed`, which keeps
//! generated files' mtimes when their content is the same.

use std::fs;
use std::path::Path;

use crate::fail;

fn cmake_var(file: &Path, name: &str) -> String {
    let text = fs::read_to_string(file).unwrap_or_default();
    let key = format!("set({name} ");
    text.lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix(&key)
                .map(|r| r.trim_end_matches(')').trim().to_string())
        })
        .unwrap_or_else(|| "0".into())
}

pub fn write_version_headers(tree: &Path, gen_dir: &Path) {
    fs::create_dir_all(gen_dir).unwrap();
    let llama = tree.join("CMakeLists.txt");
    let ggml = tree.join("ggml/CMakeLists.txt");
    let llama_version = format!(
        "{}.{}.{}",
        cmake_var(&llama, "LLAMA_VERSION_MAJOR"),
        cmake_var(&llama, "LLAMA_VERSION_MINOR"),
        cmake_var(&llama, "LLAMA_VERSION_PATCH")
    );
    let ggml_version = format!(
        "{}.{}.{}",
        cmake_var(&ggml, "GGML_VERSION_MAJOR"),
        cmake_var(&ggml, "GGML_VERSION_MINOR"),
        cmake_var(&ggml, "GGML_VERSION_PATCH")
    );
    let commit = "h2o-llama";
    write_if_changed(
        &gen_dir.join("llama-version.h"),
        &format!("#pragma once\n\n#define LLAMA_VERSION \"{llama_version}\"\n#define LLAMA_COMMIT  \"{commit}\"\n"),
    );
    write_if_changed(
        &gen_dir.join("ggml-version.h"),
        &format!("#pragma once\n\n#define GGML_VERSION \"{ggml_version}\"\n#define GGML_COMMIT  \"{commit}\"\n"),
    );
}

pub fn write_if_changed(path: &Path, content: &str) {
    if fs::read_to_string(path).ok().as_deref() != Some(content) {
        fs::write(path, content).unwrap_or_else(|e| fail(format!("write {}: {e}", path.display())));
    }
}
