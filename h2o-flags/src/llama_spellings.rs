//! llama.cpp's command-line spellings, for front ends that parse their flags with a library
//! (such as clap) that only knows one-letter short flags.
//!
//! llama-cli and llama-server spell some flags with a dash and several letters (`-ub`, `-ngl`,
//! `-np`). Users type them from habit, so `h2o-cli` and `h2o-server` accept them by rewriting
//! them to their long forms before parsing.

/// llama.cpp's multi-letter single-dash flags and the long forms they stand for.
pub const MULTI_LETTER_FLAGS: &[(&str, &str)] = &[
    ("-ub", "--ubatch-size"),
    ("-fa", "--flash-attn"),
    ("-ngl", "--n-gpu-layers"),
    ("-np", "--parallel"),
    ("-ctk", "--cache-type-k"),
    ("-ctv", "--cache-type-v"),
    ("-hf", "--hf-repo"),
];

/// Rewrites those of `flags` (taken from [`MULTI_LETTER_FLAGS`]) found in `args` to their long
/// forms, keeping a value joined with `=` (`-ub=64` → `--ubatch-size=64`). Everything after a
/// lone `--` is left alone, as it is an operand, not a flag.
///
/// # Panics
/// When `flags` names a flag that is not in [`MULTI_LETTER_FLAGS`] (a programming error).
#[must_use]
pub fn expand(args: impl IntoIterator<Item = String>, flags: &[&str]) -> Vec<String> {
    let long_forms: Vec<(&str, &str)> = flags
        .iter()
        .map(|&flag| {
            MULTI_LETTER_FLAGS
                .iter()
                .copied()
                .find(|&(short, _)| short == flag)
                .unwrap_or_else(|| panic!("{flag} is not one of llama.cpp's multi-letter flags"))
        })
        .collect();
    let long_of = |flag: &str| {
        long_forms
            .iter()
            .find(|&&(short, _)| short == flag)
            .map(|&(_, long)| long)
    };
    let mut operands = false;
    args.into_iter()
        .map(|arg| {
            if operands {
                return arg;
            }
            if arg == "--" {
                operands = true;
                return arg;
            }
            let (flag, value) = match arg.split_once('=') {
                Some((flag, value)) => (flag, Some(value)),
                None => (arg.as_str(), None),
            };
            match (long_of(flag), value) {
                (Some(long), Some(value)) => format!("{long}={value}"),
                (Some(long), None) => long.to_string(),
                (None, _) => arg,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::expand;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| (*s).to_string()).collect()
    }

    #[test]
    fn the_named_flags_get_their_long_forms() {
        let out = expand(
            strings(&["prog", "-ub", "64", "-np=2", "-ngl", "9", "-b", "128"]),
            &["-ub", "-np", "-ngl"],
        );
        assert_eq!(
            out,
            strings(&[
                "prog",
                "--ubatch-size",
                "64",
                "--parallel=2",
                "--n-gpu-layers",
                "9",
                "-b",
                "128"
            ])
        );
    }

    #[test]
    #[should_panic(expected = "-xyz is not one of llama.cpp's multi-letter flags")]
    fn a_flag_outside_the_table_is_a_programming_error_found_at_once() {
        let _ = expand(strings(&["prog"]), &["-xyz"]);
    }

    #[test]
    fn flags_not_named_and_operands_stay_as_they_are() {
        let out = expand(strings(&["prog", "-fa", "on", "--", "-ub"]), &["-ub"]);
        assert_eq!(out, strings(&["prog", "-fa", "on", "--", "-ub"]));
    }
}
