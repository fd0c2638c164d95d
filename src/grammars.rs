//! GBNF grammars (llama.cpp's `grammars/README.md` describes the format) for constrained
//! sampling through [`crate::SamplerConfig::grammar`].

/// A JSON object (RFC 8259): what `response_format: {"type": "json_object"}` asks for. Plain
/// `*` and `+` rather than bounded repeats (`{0,20}`), which llama.cpp expands into as many
/// rules and its grammar sampler into as many parse stacks, each checked against the whole
/// vocabulary at every token.
pub const JSON_OBJECT: &str = r#"root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F]) )* "\"" ws
number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [-+]? [0-9]+)? ws
ws     ::= [ \t\n]*
"#;

/// The GBNF grammar of a JSON schema, by llama.cpp's own converter (common/'s
/// `json_schema_to_grammar`, as llama-server converts `json_schema` and `response_format`).
/// `{}` is any JSON value.
///
/// # Errors
/// [`crate::Error::InvalidConfig`] with the converter's reason, for text that is not JSON or a
/// schema it cannot convert (an unknown `type`, an unresolvable `$ref`, …).
#[cfg(not(feature = "stock"))]
pub fn from_json_schema(schema: &str) -> crate::Result<String> {
    use std::ffi::{CStr, CString};

    let schema = CString::new(schema).map_err(|_| {
        crate::Error::InvalidConfig("the JSON schema contains a NUL character".into())
    })?;
    let mut error: *mut std::os::raw::c_char = std::ptr::null_mut();
    // SAFETY: a NUL-terminated schema and an out pointer; the converter catches every C++
    // exception and returns strings malloc'd by it, freed here with its own free.
    unsafe {
        let grammar = crate::sys::json_schema_to_grammar_c(schema.as_ptr(), &raw mut error);
        let take = |p: *mut std::os::raw::c_char| {
            let s = CStr::from_ptr(p).to_string_lossy().into_owned();
            crate::sys::json_schema_to_grammar_c_free(p);
            s
        };
        if grammar.is_null() {
            let reason = if error.is_null() {
                "out of memory".to_string()
            } else {
                take(error)
            };
            return Err(crate::Error::InvalidConfig(format!(
                "the JSON schema cannot be converted to a grammar: {}",
                reason.trim()
            )));
        }
        Ok(take(grammar))
    }
}

#[cfg(all(test, not(feature = "stock")))]
mod tests {
    use super::from_json_schema;

    #[test]
    fn schemas_become_grammars_and_bad_ones_are_refused_with_the_reason() {
        let g = from_json_schema(
            r#"{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}"#,
        )
        .unwrap();
        assert!(g.contains("root ::="), "{g}");
        assert!(
            g.contains("\"\\\"n\\\"\""),
            "the property's name is a literal: {g}"
        );
        assert!(from_json_schema("{}").unwrap().contains("root ::="));
        for bad in [
            r#"{"type": "hiccup"}"#,
            r#"{"type": 123}"#,
            "not json",
            "123",
        ] {
            let e = from_json_schema(bad).expect_err(bad);
            assert!(e.to_string().contains("cannot be converted"), "{bad}: {e}");
        }
    }
}
