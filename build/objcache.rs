//! The content-addressed object cache shared by every profile and flavour: where it is, the
//! per-group header digests, the compiler's identity, and `compile_cached`, which compiles a
//! unit only when no object with the same key (compiler, flags without include paths, headers,
//! source content) is cached.

use std::collections::BTreeMap;
use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

/// Hashes the names (relative to `root`, so that every OUT_DIR agrees) and contents of the
/// headers in `dirs`.
fn digest_headers(root: &Path, dirs: &[PathBuf], recursive: bool, hasher: &mut Sha256) {
    for dir in dirs {
        let mut entries: Vec<PathBuf> = match fs::read_dir(dir) {
            Ok(rd) => rd.filter_map(|e| e.ok().map(|e| e.path())).collect(),
            Err(_) => continue,
        };
        entries.sort();
        for p in entries {
            if p.is_dir() {
                if recursive {
                    digest_headers(root, &[p], true, hasher);
                }
            } else if p
                .extension()
                .is_some_and(|x| x == "h" || x == "hpp" || x == "inc")
            {
                hasher.update(
                    p.strip_prefix(root)
                        .unwrap_or(&p)
                        .to_string_lossy()
                        .as_bytes(),
                );
                hasher.update(fs::read(&p).unwrap());
            }
        }
    }
}

/// The digests of the header sets a unit can depend on (`Unit::headers`): "ggml" covers ggml's
/// public and internal headers, ggml-cpu's and the generated version headers; "llama" covers
/// those and llama's.
pub fn header_digests(tree: &Path, gen_dir: &Path) -> BTreeMap<&'static str, Vec<u8>> {
    let ggml_src = tree.join("ggml/src");
    let cpu_src = ggml_src.join("ggml-cpu");
    let llama_src = tree.join("src");
    let mut header_digests: BTreeMap<&'static str, Vec<u8>> = BTreeMap::new();
    let mut h = Sha256::new();
    digest_headers(tree, &[tree.join("ggml/include"), ggml_src], false, &mut h);
    digest_headers(tree, std::slice::from_ref(&cpu_src), true, &mut h);
    digest_headers(gen_dir, &[gen_dir.to_path_buf()], false, &mut h);
    let ggml_digest = h.clone().finalize().to_vec();
    digest_headers(tree, &[tree.join("include"), llama_src], true, &mut h);
    let llama_digest = h.clone().finalize().to_vec();
    // common/ with its jinja/ and parsers/ headers
    digest_headers(tree, &[tree.join("common")], true, &mut h);
    digest_headers(tree, &[tree.join("vendor/nlohmann")], false, &mut h);
    header_digests.insert("ggml", ggml_digest);
    header_digests.insert("llama", llama_digest);
    header_digests.insert("common", h.finalize().to_vec());
    header_digests
}

/// Locates the object cache: `<target dir>/h2o-llama-objcache`, shared by debug, release and
/// the `stock` flavour so that only translation units whose inputs differ are compiled twice
/// (between the two flavours, every unit: the hooks change a header of each group).
pub fn object_cache_dir(out_dir: &Path) -> PathBuf {
    if let Some(dir) = env::var_os("H2O_LLAMA_OBJ_CACHE") {
        return PathBuf::from(dir);
    }
    // OUT_DIR = <target>/[<triple>/]<profile>/build/<pkg>-<hash>/out
    let build = out_dir
        .ancestors()
        .find(|a| a.file_name().is_some_and(|n| n == "build"));
    match build.and_then(|b| b.parent()).and_then(|p| p.parent()) {
        Some(target) => target.join("h2o-llama-objcache"),
        None => out_dir.join("objcache"),
    }
}

pub fn compiler_identity(compiler: &Path) -> String {
    Command::new(compiler)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// One translation unit for `compile_cached`.
pub struct CompileJob<'a> {
    pub compiler: &'a Path,
    pub compiler_id: &'a str,
    pub flags: &'a [String],
    /// Digest of the headers the unit can include.
    pub header_digest: &'a [u8],
    /// Stable name of the source (relative to its tree), part of the cache key.
    pub key_name: &'a str,
    pub source: &'a Path,
    /// Files whose content the object depends on instead of `source`'s (a unity file's members).
    pub members: &'a [PathBuf],
    pub tree: &'a Path,
}

/// Compiles a unit into the content-addressed object cache unless an object with the same key
/// (compiler, flags without include paths, headers, source content) is there already.
/// Returns the object and whether it was compiled now.
pub fn compile_cached(job: &CompileJob, cache: &Path) -> Result<(PathBuf, bool), String> {
    let mut key = Sha256::new();
    key.update(job.compiler_id.as_bytes());
    key.update(job.compiler.to_string_lossy().as_bytes());
    for f in job.flags {
        // Include paths differ between OUT_DIRs but not in meaning; the header digest covers
        // what they point to.
        if !f.starts_with("-I") {
            key.update(f.as_bytes());
        }
    }
    key.update(job.header_digest);
    key.update(job.key_name.as_bytes());
    if job.members.is_empty() {
        key.update(
            job.source
                .strip_prefix(job.tree)
                .unwrap_or(job.source)
                .to_string_lossy()
                .as_bytes(),
        );
        key.update(fs::read(job.source).unwrap_or_default());
    }
    for f in job.members {
        // a unity file's text holds absolute paths; its members are hashed instead
        key.update(
            f.strip_prefix(job.tree)
                .unwrap_or(f)
                .to_string_lossy()
                .as_bytes(),
        );
        key.update(fs::read(f).unwrap_or_default());
    }
    let stem = job
        .source
        .file_stem()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let hex: String = key
        .finalize()
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect();
    let obj = cache.join(format!("{stem}-{hex}.o"));
    if obj.is_file() {
        return Ok((obj, false));
    }
    let tmp = cache.join(format!("{stem}-{hex}.o.tmp{}", std::process::id()));
    let out = Command::new(job.compiler)
        .args(job.flags)
        .arg("-c")
        .arg(job.source)
        .arg("-o")
        .arg(&tmp)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", job.compiler.display()))?;
    if !out.status.success() {
        let _ = fs::remove_file(&tmp);
        return Err(format!(
            "compiling {} failed:\n{}",
            job.source.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    fs::rename(&tmp, &obj).map_err(|e| format!("rename {}: {e}", tmp.display()))?;
    Ok((obj, true))
}
