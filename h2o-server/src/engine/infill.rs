//! llama-server's `/infill` prompt: code completion between a prefix and a suffix with the
//! fill-in-the-middle tokens the model's vocabulary declares, laid out by llama-server's rules
//! so that editor plugins written for it (llama.vim, llama.vscode) get the same prompt:
//!
//! ```text
//! [extra]  [BOS] FIM_PRE prefix prompt  FIM_SUF suffix  FIM_MID
//! ```
//!
//! where `extra` is the repository context, the request's `input_extra` files: `FIM_REP
//! "myproject\n"` (where the vocabulary has it), then per file `FIM_SEP "filename\n" text` (or,
//! without `FIM_SEP`, a `"\n\n--- snippet ---\n\n"` separator before its text), then `FIM_SEP
//! "filename\n"` for the file being edited. What fits one batch is taken: the prefix's last
//! 3/4 of `-b`, the suffix's first `-b`/4 less the prompt and two tokens; the rest of the slot,
//! less `-b` and twice `n_predict`, holds the end of `extra`.

use h2o_llama::{FimTokens, Token};

use super::{Infill, JobError};

/// The prompt of `infill` for a model with the fill-in-the-middle tokens `fim` and, where its
/// tokenizer adds one, the `bos` token; `tokenize` turns text into tokens without special ones.
/// `n_batch` is `-b`, `n_ctx` the slot's context.
pub fn infill_tokens(
    fim: &FimTokens,
    bos: Option<Token>,
    tokenize: &dyn Fn(&str) -> Result<Vec<Token>, JobError>,
    infill: &Infill,
    n_batch: usize,
    n_ctx: usize,
) -> Result<Vec<Token>, JobError> {
    let (Some(pre), Some(suf), Some(mid)) = (fim.prefix, fim.suffix, fim.middle) else {
        return Err(JobError::BadPrompt(not_supported(fim)));
    };
    let mut extra: Vec<Token> = Vec::new();
    if let Some(repo) = fim.repo {
        extra.push(repo);
        extra.extend(tokenize("myproject\n")?);
    }
    for chunk in &infill.extra {
        match fim.separator {
            Some(sep) => {
                extra.push(sep);
                extra.extend(tokenize(&format!("{}\n", chunk.filename))?);
            }
            None => extra.extend(tokenize("\n\n--- snippet ---\n\n")?),
        }
        extra.extend(tokenize(&chunk.text)?);
    }
    if let Some(sep) = fim.separator {
        extra.push(sep);
        extra.extend(tokenize("filename\n")?);
    }
    let prefix = tokenize(&infill.prefix)?;
    let suffix = tokenize(&infill.suffix)?;
    let prompt = tokenize(&infill.prompt)?;

    // the prefix's end and the suffix's start, in a 3:1 share of one batch
    let quarter = (n_batch / 4) as i64;
    let prefix_take = prefix.len().min(3 * quarter as usize);
    let suffix_take = (suffix.len() as i64).min((quarter - (2 + prompt.len() as i64)).max(0));
    let extra_room = (n_ctx as i64 - n_batch as i64 - 2 * infill.n_predict).max(0);
    let extra_take = (extra.len() as i64).min(extra_room) as usize;

    let mut tokens: Vec<Token> = extra[extra.len() - extra_take..].to_vec();
    tokens.extend(bos);
    tokens.push(pre);
    tokens.extend_from_slice(&prefix[prefix.len() - prefix_take..]);
    tokens.extend_from_slice(&prompt);
    tokens.push(suf);
    tokens.extend_from_slice(&suffix[..suffix_take as usize]);
    tokens.push(mid);
    Ok(tokens)
}

/// llama-server's answer where the vocabulary lacks a token infill needs.
pub fn not_supported(fim: &FimTokens) -> String {
    let mut missing = String::new();
    for (token, what) in [
        (fim.prefix, "prefix"),
        (fim.suffix, "suffix"),
        (fim.middle, "middle"),
    ] {
        if token.is_none() {
            missing += &format!("{what} token is missing. ");
        }
    }
    format!("Infill is not supported by this model: {missing}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::InfillChunk;

    /// One token per byte, offset so that no byte is mistaken for a special token below 1,000.
    fn bytes(text: &str) -> Result<Vec<Token>, JobError> {
        Ok(text.bytes().map(|b| 1000 + Token::from(b)).collect())
    }

    fn t(text: &str) -> Vec<Token> {
        bytes(text).unwrap()
    }

    const PRE: Token = 1;
    const SUF: Token = 2;
    const MID: Token = 3;
    const REP: Token = 4;
    const SEP: Token = 5;
    const BOS: Token = 9;

    fn fim(repo_level: bool) -> FimTokens {
        FimTokens {
            prefix: Some(PRE),
            suffix: Some(SUF),
            middle: Some(MID),
            repo: repo_level.then_some(REP),
            separator: repo_level.then_some(SEP),
        }
    }

    fn request(extra: &[(&str, &str)]) -> Infill {
        Infill {
            prefix: "def f(".into(),
            suffix: "):\n".into(),
            extra: extra
                .iter()
                .map(|(f, text)| InfillChunk {
                    filename: f.to_string(),
                    text: text.to_string(),
                })
                .collect(),
            prompt: "x".into(),
            n_predict: 8,
        }
    }

    fn cat(parts: &[Vec<Token>]) -> Vec<Token> {
        parts.concat()
    }

    #[test]
    fn prefix_prompt_suffix_middle_after_the_bos() {
        let got = infill_tokens(&fim(false), Some(BOS), &bytes, &request(&[]), 512, 4096).unwrap();
        let want = cat(&[
            vec![BOS, PRE],
            t("def f("),
            t("x"),
            vec![SUF],
            t("):\n"),
            vec![MID],
        ]);
        assert_eq!(got, want);
        // without a BOS in the tokenizer, none
        let got = infill_tokens(&fim(false), None, &bytes, &request(&[]), 512, 4096).unwrap();
        assert_eq!(got, want[1..]);
    }

    #[test]
    fn extra_files_come_first_with_the_repository_tokens() {
        let r = request(&[("a.py", "A"), ("b.py", "B")]);
        let got = infill_tokens(&fim(true), Some(BOS), &bytes, &r, 512, 4096).unwrap();
        let want = cat(&[
            vec![REP],
            t("myproject\n"),
            vec![SEP],
            t("a.py\n"),
            t("A"),
            vec![SEP],
            t("b.py\n"),
            t("B"),
            vec![SEP],
            t("filename\n"),
            vec![BOS, PRE],
            t("def f("),
            t("x"),
            vec![SUF],
            t("):\n"),
            vec![MID],
        ]);
        assert_eq!(got, want);
        // without the repository tokens, a snippet separator before each file's text
        let got = infill_tokens(&fim(false), None, &bytes, &r, 512, 4096).unwrap();
        let sep = t("\n\n--- snippet ---\n\n");
        let want = cat(&[
            sep.clone(),
            t("A"),
            sep,
            t("B"),
            vec![PRE],
            t("def f("),
            t("x"),
            vec![SUF],
            t("):\n"),
            vec![MID],
        ]);
        assert_eq!(got, want);
    }

    #[test]
    fn what_does_not_fit_a_batch_is_cut_from_the_far_ends() {
        let r = Infill {
            prefix: "p".repeat(100),
            suffix: "s".repeat(100),
            prompt: "ab".into(),
            extra: vec![InfillChunk {
                filename: "f".into(),
                text: "e".repeat(100),
            }],
            n_predict: 10,
        };
        // -b 64: the prefix's last 48, the suffix's first 16 - (2 + 2) = 12; the slot of 150
        // leaves 150 - 64 - 20 = 66 tokens for the end of the extra context
        let got = infill_tokens(&fim(true), None, &bytes, &r, 64, 150).unwrap();
        let mut extra = cat(&[
            vec![REP],
            t("myproject\n"),
            vec![SEP],
            t("f\n"),
            t(&"e".repeat(100)),
        ]);
        extra.extend(cat(&[vec![SEP], t("filename\n")]));
        let want = cat(&[
            extra[extra.len() - 66..].to_vec(),
            vec![PRE],
            t(&"p".repeat(48)),
            t("ab"),
            vec![SUF],
            t(&"s".repeat(12)),
            vec![MID],
        ]);
        assert_eq!(got, want);
        // a prompt that fills the suffix's share leaves no suffix; no room leaves no extra
        let long = Infill {
            prompt: "q".repeat(20),
            n_predict: 100,
            ..r
        };
        let got = infill_tokens(&fim(true), None, &bytes, &long, 64, 150).unwrap();
        assert_eq!(got[0], PRE);
        assert_eq!(&got[got.len() - 2..], &[SUF, MID]);
    }

    #[test]
    fn a_vocabulary_without_the_tokens_is_named() {
        let none = FimTokens::default();
        let err = infill_tokens(&none, None, &bytes, &request(&[]), 512, 4096).unwrap_err();
        let JobError::BadPrompt(msg) = err else {
            panic!("{err:?}");
        };
        assert_eq!(
            msg,
            "Infill is not supported by this model: prefix token is missing. suffix token is \
             missing. middle token is missing. "
        );
    }
}
