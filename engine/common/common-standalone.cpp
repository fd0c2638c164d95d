// the helpers of common.cpp that common/'s C entry points (json-schema-to-grammar-c.cpp,
// chat-c.cpp) and the sources they link use, for builds that link those without common.cpp,
// which pulls in sampling, speculative decoding and model fitting
//
// not part of the CMake build, which links common.cpp itself

#ifdef LLAMA_COMMON_STANDALONE

#include "common.h"

#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

std::string string_join(const std::vector<std::string> & values, const std::string & separator) {
    std::ostringstream result;
    for (size_t i = 0; i < values.size(); ++i) {
        if (i > 0) {
            result << separator;
        }
        result << values[i];
    }
    return result.str();
}

std::vector<std::string> string_split(const std::string & str, const std::string & delimiter) {
    std::vector<std::string> parts;
    size_t start = 0;
    size_t end = str.find(delimiter);
    while (end != std::string::npos) {
        parts.push_back(str.substr(start, end - start));
        start = end + delimiter.length();
        end = str.find(delimiter, start);
    }
    parts.push_back(str.substr(start));
    return parts;
}

std::string string_repeat(const std::string & str, size_t n) {
    if (n == 0) {
        return "";
    }
    std::string result;
    result.reserve(str.length() * n);
    for (size_t i = 0; i < n; ++i) {
        result += str;
    }
    return result;
}

void string_replace_all(std::string & s, const std::string & search, const std::string & replace) {
    if (search.empty()) {
        return;
    }
    std::string result;
    result.reserve(s.length());
    size_t last = 0;
    size_t pos;
    while ((pos = s.find(search, last)) != std::string::npos) {
        result.append(s, last, pos - last);
        result.append(replace);
        last = pos + search.length();
    }
    result.append(s, last, std::string::npos);
    s = std::move(result);
}

std::vector<llama_token> common_tokenize(
    const struct llama_vocab * vocab,
           const std::string & text,
                        bool   add_special,
                        bool   parse_special) {
    std::vector<llama_token> result(text.length() + 2 * add_special);
    int32_t n = llama_tokenize(vocab, text.data(), text.length(), result.data(), result.size(), add_special, parse_special);
    if (n == std::numeric_limits<int32_t>::min()) {
        throw std::runtime_error("tokenization failed: the text takes more than INT32_MAX tokens");
    }
    if (n < 0) {
        result.resize(-n);
        n = llama_tokenize(vocab, text.data(), text.length(), result.data(), result.size(), add_special, parse_special);
        GGML_ASSERT(n == (int32_t) result.size());
    }
    result.resize(n);
    return result;
}

std::string common_token_to_piece(const struct llama_vocab * vocab, llama_token token, bool special) {
    std::string piece(16, '\0');
    int32_t n = llama_token_to_piece(vocab, token, &piece[0], piece.size(), 0, special);
    if (n < 0) {
        piece.resize(-n);
        n = llama_token_to_piece(vocab, token, &piece[0], piece.size(), 0, special);
        GGML_ASSERT(n == (int32_t) piece.size());
    }
    piece.resize(n);
    return piece;
}

// log.cpp colours its output only where these say so: FFI callers own the terminal
bool tty_can_use_colors() {
    return false;
}

bool tty_enable_ansi() {
    return false;
}

#endif // LLAMA_COMMON_STANDALONE
