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
