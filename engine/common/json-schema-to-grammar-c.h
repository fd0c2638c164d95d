#pragma once

// C entry point of json_schema_to_grammar, for callers outside C++ (FFI) that link only the
// converter and its JSON library, not the rest of common/

#ifdef __cplusplus
extern "C" {
#endif

// convert a JSON schema, given as JSON text, to a GBNF grammar whose root rule is "root"
// on success: returns the grammar and sets *error to NULL
// on failure: returns NULL and sets *error to the reason
// free both with json_schema_to_grammar_c_free
char * json_schema_to_grammar_c(const char * schema, char ** error);

void json_schema_to_grammar_c_free(char * text);

#ifdef __cplusplus
}
#endif
