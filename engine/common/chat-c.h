#pragma once

// C entry points of common/'s chat templates (Jinja, with tool definitions) and of the parsers
// of their replies (content, reasoning and tool calls), for callers outside C++ (FFI) that link
// the chat sources of common/ without common.cpp (see common-standalone.cpp)
//
// requests, replies and messages travel as JSON text in the shapes of OpenAI's chat API, as
// llama-server reads and writes them

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

struct common_chat_c_templates;
struct common_chat_c_parser;

// the chat templates of `model`, or `chat_template` (Jinja source) in place of the model's own
// when not NULL
// on failure: returns NULL and sets *error to the reason
struct common_chat_c_templates * common_chat_c_templates_init(
        const struct llama_model * model,
        const char               * chat_template,
        char                    ** error);

void common_chat_c_templates_free(struct common_chat_c_templates * tmpls);

// what the templates are: a JSON object with source (the Jinja text of the default template) and
// caps (what the template supports: supports_tools, supports_tool_calls, supports_system_role, …),
// as llama-server's /props reports them
char * common_chat_c_templates_info(const struct common_chat_c_templates * tmpls);

// render a chat request, a JSON object with the fields of llama-server's chat endpoint:
//   messages, tools, tool_choice ("auto", "required", "none"), parallel_tool_calls,
//   add_generation_prompt, json_schema, grammar, chat_template_kwargs, enable_thinking,
//   reasoning_format ("none", "auto", "deepseek", "deepseek-legacy")
// returns a JSON object:
//   prompt, format (the parser's name), grammar, grammar_lazy,
//   grammar_trigger_patterns (regexes), grammar_trigger_tokens (token ids), a lazy grammar's
//   triggers; grammar_prefill_tokens (token ids), the generation prompt's, for the grammar
//   sampler to accept before the first sampled token;
//   preserved_tokens (token ids to render as text), additional_stops
// and sets *parser to the parser of the reply (free it with common_chat_c_parser_free)
// on failure: returns NULL and sets *error to the reason; tools (unless tool_choice is "none")
// on a template that renders no tool calls fail
char * common_chat_c_apply(
        const struct common_chat_c_templates * tmpls,
        const char                           * request,
        struct common_chat_c_parser         ** parser,
        char                                ** error);

// parse the reply generated so far (the whole text, not the new part); `is_partial` when more
// may follow
// returns a JSON object:
//   message: the assistant message (role, content, reasoning_content, tool_calls with ids)
//   diffs:   what changed since the previous call, in order: objects with content_delta,
//            reasoning_content_delta, and tool_call_index with tool_call (name, arguments, id)
// on failure: returns NULL and sets *error to the reason; a reply that does not match the
// template's format fails only when !is_partial
char * common_chat_c_parser_update(
        struct common_chat_c_parser * parser,
        const char                  * text,
        bool                          is_partial,
        char                       ** error);

void common_chat_c_parser_free(struct common_chat_c_parser * parser);

// free a string returned by the functions above
void common_chat_c_free(char * text);

#ifdef __cplusplus
}
#endif
