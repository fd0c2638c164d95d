// Streaming state: a context's state handed to a caller's writer and read back from a caller's reader
// piece by piece (llama_state_write_stream, llama_state_read_stream), so that saving or restoring a
// state of several GB never holds a second copy of it. The bytes are exactly those of
// llama_state_get_data and llama_state_seq_get_data.

#include "llama-context.h"
#include "llama-io.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

// tensors outside host memory pass through a buffer of at most this size
static constexpr size_t LLAMA_STATE_STREAM_PIECE = 4u*1024u*1024u;

static bool llama_state_stream_is_host(const ggml_tensor * tensor) {
    const ggml_backend_buffer_t buf = tensor->view_src ? tensor->view_src->buffer : tensor->buffer;
    return buf != nullptr && ggml_backend_buffer_is_host(buf) && tensor->data != nullptr;
}

class llama_io_write_stream : public llama_io_write_i {
public:
    llama_io_write_stream(llama_state_write_fn fn, void * user_data) : fn(fn), user_data(user_data) {}

    void write(const void * src, size_t size) override {
        if (size > 0 && !fn(src, size, user_data)) {
            throw std::runtime_error("the state's writer stopped");
        }
        size_written += size;
    }

    void write_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        GGML_ASSERT(offset + size <= ggml_nbytes(tensor));
        if (llama_state_stream_is_host(tensor)) {
            // in place: no copy between the cache and the writer
            write((const uint8_t *) tensor->data + offset, size);
            return;
        }
        for (size_t done = 0; done < size; ) {
            const size_t n = std::min(size - done, LLAMA_STATE_STREAM_PIECE);
            buf.resize(n);
            ggml_backend_tensor_get(tensor, buf.data(), offset + done, n);
            write(buf.data(), n);
            done += n;
        }
    }

    size_t n_bytes() override {
        return size_written;
    }

private:
    llama_state_write_fn fn;
    void * user_data;
    size_t size_written = 0;
    std::vector<uint8_t> buf;
};

class llama_io_read_stream : public llama_io_read_i {
public:
    llama_io_read_stream(llama_state_read_fn fn, void * user_data) : fn(fn), user_data(user_data) {}

    void read(void * dst, size_t size) override {
        if (size > 0 && !fn(dst, size, user_data)) {
            throw std::runtime_error("the state's reader stopped (the state is cut short or failed its check)");
        }
        size_read += size;
    }

    void read_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        GGML_ASSERT(offset + size <= ggml_nbytes(tensor));
        if (llama_state_stream_is_host(tensor)) {
            read((uint8_t *) tensor->data + offset, size);
            return;
        }
        for (size_t done = 0; done < size; ) {
            const size_t n = std::min(size - done, LLAMA_STATE_STREAM_PIECE);
            buf.resize(n);
            read(buf.data(), n);
            ggml_backend_tensor_set(tensor, buf.data(), offset + done, n);
            done += n;
        }
    }

    size_t n_bytes() override {
        return size_read;
    }

private:
    llama_state_read_fn fn;
    void * user_data;
    size_t size_read = 0;
    std::vector<uint8_t> buf;
};

size_t llama_state_write_stream(llama_context * ctx, llama_seq_id seq_id, llama_state_write_fn write, void * user_data) {
    ctx->synchronize();

    llama_io_write_stream io(write, user_data);
    return ctx->state_write_io(io, seq_id);
}

size_t llama_state_read_stream(llama_context * ctx, llama_seq_id dest_seq_id, llama_state_read_fn read, void * user_data) {
    ctx->synchronize();

    llama_io_read_stream io(read, user_data);
    return ctx->state_read_io(io, dest_seq_id);
}
