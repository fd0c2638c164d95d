#include "json-schema-to-grammar-c.h"
#include "json-schema-to-grammar.h"
#include "common.h"

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

static char * json_schema_to_grammar_c_dup(const std::string & text) {
    char * result = (char *) malloc(text.size() + 1);
    if (result != nullptr) {
        memcpy(result, text.c_str(), text.size() + 1);
    }
    return result;
}

char * json_schema_to_grammar_c(const char * schema, char ** error) {
    *error = nullptr;
    try {
        return json_schema_to_grammar_c_dup(json_schema_to_grammar(common_json::parse(schema)));
    } catch (const std::exception & e) {
        *error = json_schema_to_grammar_c_dup(e.what());
    } catch (...) {
        *error = json_schema_to_grammar_c_dup("unknown error");
    }
    return nullptr;
}

void json_schema_to_grammar_c_free(char * text) {
    free(text);
}
