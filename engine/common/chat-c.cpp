#include "chat-c.h"
#include "chat.h"
#include "common.h"
#include "json.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <vector>

using json = common_json;

struct common_chat_c_templates {
    const llama_model       * model;
    common_chat_templates_ptr tmpls;
};

struct common_chat_c_parser {
    common_chat_parser_params params;
    common_chat_msg           msg;      // the reply as parsed by the previous update
    std::vector<std::string>  call_ids; // one per tool call, kept from one update to the next
    std::mt19937              rng;
};

static char * common_chat_c_dup(const std::string & text) {
    char * result = (char *) malloc(text.size() + 1);
    if (result != nullptr) {
        memcpy(result, text.c_str(), text.size() + 1);
    }
    return result;
}

static void common_chat_c_set_error(char ** error, const char * what) {
    if (error != nullptr) {
        *error = common_chat_c_dup(what);
    }
}

struct common_chat_c_templates * common_chat_c_templates_init(
        const struct llama_model * model,
        const char               * chat_template,
        char                    ** error) {
    *error = nullptr;
    try {
        auto * result  = new common_chat_c_templates;
        result->model  = model;
        result->tmpls  = common_chat_templates_init(model, chat_template != nullptr ? chat_template : "");
        return result;
    } catch (const std::exception & e) {
        common_chat_c_set_error(error, e.what());
    } catch (...) {
        common_chat_c_set_error(error, "unknown error");
    }
    return nullptr;
}

void common_chat_c_templates_free(struct common_chat_c_templates * tmpls) {
    delete tmpls;
}

char * common_chat_c_templates_info(const struct common_chat_c_templates * tmpls) {
    try {
        json caps = json::object();
        for (const auto & [name, value] : common_chat_templates_get_caps(tmpls->tmpls.get())) {
            caps[name] = value;
        }
        json info = json::object();
        info["source"] = common_chat_templates_source(tmpls->tmpls.get());
        info["caps"]   = caps;
        return common_chat_c_dup(info.dump());
    } catch (...) {
        return nullptr;
    }
}

// the one token `text` is in the model's vocabulary (special tokens included), or LLAMA_TOKEN_NULL
// when it takes several
static llama_token common_chat_c_single_token(const llama_vocab * vocab, const std::string & text) {
    const auto ids = common_tokenize(vocab, text, /* add_special= */ false, /* parse_special= */ true);
    return ids.size() == 1 ? ids[0] : LLAMA_TOKEN_NULL;
}

static std::string common_chat_c_regex_escape(const std::string & s) {
    static const std::string special = ".^$|()*+?[]{}\\";
    std::string result;
    for (char c : s) {
        if (special.find(c) != std::string::npos) {
            result += '\\';
        }
        result += c;
    }
    return result;
}

// a grammar trigger as the grammar sampler takes it (llama_sampler_init_grammar_lazy_patterns):
// a word that is one preserved token triggers on that token, as in llama-server; other words
// are escaped into patterns; full patterns are anchored at both ends
static void common_chat_c_add_trigger(
        const llama_vocab                 * vocab,
        const common_grammar_trigger      & trigger,
        const std::vector<llama_token>    & preserved,
        json                              & patterns,
        json                              & tokens) {
    switch (trigger.type) {
        case COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN:
            tokens.push_back(trigger.token);
            break;
        case COMMON_GRAMMAR_TRIGGER_TYPE_WORD:
            {
                const llama_token token = common_chat_c_single_token(vocab, trigger.value);
                if (token != LLAMA_TOKEN_NULL) {
                    if (std::find(preserved.begin(), preserved.end(), token) == preserved.end()) {
                        throw std::runtime_error("grammar trigger word should be marked as a preserved token: " + trigger.value);
                    }
                    tokens.push_back(token);
                } else {
                    patterns.push_back(common_chat_c_regex_escape(trigger.value));
                }
            } break;
        case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN:
            patterns.push_back(trigger.value);
            break;
        case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN_FULL:
            {
                const std::string & p = trigger.value;
                std::string anchored = "^$";
                if (!p.empty()) {
                    anchored = (p.front() != '^' ? "^" : "") + p + (p.back() != '$' ? "$" : "");
                }
                patterns.push_back(anchored);
            } break;
        default:
            throw std::runtime_error("unknown grammar trigger type");
    }
}

static common_chat_templates_inputs common_chat_c_inputs(const json & req) {
    common_chat_templates_inputs inputs;
    inputs.messages = common_chat_msgs_parse_oaicompat(req.at("messages"));
    if (req.contains("tools") && !req.at("tools").is_null()) {
        inputs.tools = common_chat_tools_parse_oaicompat(req.at("tools"));
    }
    if (req.contains("tool_choice") && !req.at("tool_choice").is_null()) {
        inputs.tool_choice = common_chat_tool_choice_parse_oaicompat(req.at("tool_choice").get<std::string>());
    }
    inputs.parallel_tool_calls   = req.value("parallel_tool_calls", false);
    inputs.add_generation_prompt = req.value("add_generation_prompt", true);
    inputs.json_schema           = req.contains("json_schema") && !req.at("json_schema").is_null() ? req.at("json_schema").dump() : "";
    inputs.grammar               = req.value("grammar", std::string());
    inputs.enable_thinking       = req.value("enable_thinking", true);
    inputs.reasoning_format      = common_reasoning_format_from_name(req.value("reasoning_format", std::string("deepseek")));
    if (req.contains("chat_template_kwargs")) {
        for (const auto & item : req.at("chat_template_kwargs").items()) {
            inputs.chat_template_kwargs[item.key()] = item.value().dump();
        }
    }
    if (!inputs.json_schema.empty() && !inputs.grammar.empty()) {
        throw std::invalid_argument("json_schema and grammar both constrain the reply: send one");
    }
    return inputs;
}

char * common_chat_c_apply(
        const struct common_chat_c_templates * tmpls,
        const char                           * request,
        struct common_chat_c_parser         ** parser,
        char                                ** error) {
    *error  = nullptr;
    *parser = nullptr;
    try {
        const json req    = json::parse(request);
        const auto inputs = common_chat_c_inputs(req);
        if (!inputs.tools.empty() && inputs.tool_choice != COMMON_CHAT_TOOL_CHOICE_NONE &&
                !common_chat_templates_get_caps(tmpls->tmpls.get()).at("supports_tool_calls")) {
            // rendered anyway, the tools would be left out of the prompt and never called
            throw std::invalid_argument("the chat template does not support tool calls");
        }
        const auto params = common_chat_templates_apply(tmpls->tmpls.get(), inputs);

        const llama_vocab * vocab = llama_model_get_vocab(tmpls->model);

        json preserved = json::array();
        std::vector<llama_token> preserved_ids;
        for (const auto & text : params.preserved_tokens) {
            const llama_token token = common_chat_c_single_token(vocab, text);
            if (token != LLAMA_TOKEN_NULL) {
                preserved.push_back(token);
                preserved_ids.push_back(token);
            }
        }
        json patterns = json::array();
        json tokens   = json::array();
        for (const auto & trigger : params.grammar_triggers) {
            common_chat_c_add_trigger(vocab, trigger, preserved_ids, patterns, tokens);
        }
        // a grammar the template made (for tools or a schema) starts with the generation prompt,
        // which the prompt already holds: the grammar sampler accepts its tokens first, as
        // common_sampler does; a request's own grammar is taken as it is
        json prefill = json::array();
        if (!params.grammar.empty() && !params.grammar_lazy && inputs.grammar.empty()) {
            const auto ids = common_tokenize(vocab, params.generation_prompt, /* add_special= */ false, /* parse_special= */ true);
            for (size_t i = 0; i < ids.size(); ++i) {
                const std::string piece = common_token_to_piece(vocab, ids[i], true);
                if (i == 0 && !piece.empty() && std::isspace((unsigned char) piece[0]) &&
                        !std::isspace((unsigned char) params.generation_prompt[0])) {
                    // some tokenizers put a space before the first special token
                    continue;
                }
                prefill.push_back(ids[i]);
            }
        }
        json stops = json::array();
        for (const auto & stop : params.additional_stops) {
            stops.push_back(stop);
        }

        json result = json::object();
        result["prompt"]                   = params.prompt;
        result["format"]                   = common_chat_format_name(params.format);
        result["grammar"]                  = params.grammar;
        result["grammar_lazy"]             = params.grammar_lazy;
        result["grammar_prefill_tokens"]   = prefill;
        result["grammar_trigger_patterns"] = patterns;
        result["grammar_trigger_tokens"]   = tokens;
        result["preserved_tokens"]         = preserved;
        result["additional_stops"]         = stops;

        auto * p = new common_chat_c_parser;
        p->params = common_chat_parser_params(params);
        p->params.reasoning_format = inputs.reasoning_format;
        p->params.parse_tool_calls = !inputs.tools.empty() && inputs.tool_choice != COMMON_CHAT_TOOL_CHOICE_NONE;
        if (!params.parser.empty()) {
            p->params.parser.load(params.parser);
        }
        p->rng.seed(std::random_device{}());

        char * text = common_chat_c_dup(result.dump());
        *parser = p;
        return text;
    } catch (const std::exception & e) {
        common_chat_c_set_error(error, e.what());
    } catch (...) {
        common_chat_c_set_error(error, "unknown error");
    }
    return nullptr;
}

// a tool call id in the form llama-server gives them
static std::string common_chat_c_call_id(std::mt19937 & rng) {
    static const char chars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    std::uniform_int_distribution<int> pick(0, (int) sizeof(chars) - 2);
    std::string id;
    for (int i = 0; i < 32; ++i) {
        id += chars[pick(rng)];
    }
    return id;
}

char * common_chat_c_parser_update(
        struct common_chat_c_parser * parser,
        const char                  * text,
        bool                          is_partial,
        char                       ** error) {
    *error = nullptr;
    try {
        common_chat_msg msg = common_chat_parse(text, is_partial, parser->params);
        msg.set_tool_call_ids(parser->call_ids, [parser]() { return common_chat_c_call_id(parser->rng); });

        json diffs = json::array();
        for (const auto & diff : common_chat_msg_diff::compute_diffs(parser->msg, msg)) {
            json d = json::object();
            d["content_delta"]           = diff.content_delta;
            d["reasoning_content_delta"] = diff.reasoning_content_delta;
            if (diff.tool_call_index != std::string::npos) {
                json call = json::object();
                call["name"]      = diff.tool_call_delta.name;
                call["arguments"] = diff.tool_call_delta.arguments;
                call["id"]        = diff.tool_call_delta.id;
                d["tool_call_index"] = diff.tool_call_index;
                d["tool_call"]       = call;
            }
            diffs.push_back(d);
        }

        json calls = json::array();
        for (const auto & call : msg.tool_calls) {
            json c = json::object();
            c["name"]      = call.name;
            c["arguments"] = call.arguments;
            c["id"]        = call.id;
            calls.push_back(c);
        }
        json message = json::object();
        message["role"]              = "assistant";
        message["content"]           = msg.content;
        message["reasoning_content"] = msg.reasoning_content;
        message["tool_calls"]        = calls;

        json result = json::object();
        result["message"] = message;
        result["diffs"]   = diffs;

        parser->msg = std::move(msg);
        return common_chat_c_dup(result.dump());
    } catch (const std::exception & e) {
        common_chat_c_set_error(error, e.what());
    } catch (...) {
        common_chat_c_set_error(error, "unknown error");
    }
    return nullptr;
}

void common_chat_c_parser_free(struct common_chat_c_parser * parser) {
    delete parser;
}

void common_chat_c_free(char * text) {
    free(text);
}
