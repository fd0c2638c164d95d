#!/usr/bin/env python3
"""Starts h2o-server with the command line llama.cpp's server tests give llama-server.

llama.cpp's pytest suite (tools/server/tests) starts `$LLAMA_SERVER_BIN_PATH` with llama-server's
flags. h2o-server takes most of them as they are; this drops the ones that name what it does not
have (HuggingFace downloads, embeddings, reranking, media, LoRA, speculative drafts, the router),
so that the default model serves in place of the suite's tiny ones. H2O_SERVER names the binary;
H2O_SERVER_ARGS (split at spaces) are added, e.g. "--h2o-local 16 --h2o-heavy 16".
"""
import os
import sys

# flags followed by a value, and flags alone, that are left out
DROP_WITH_VALUE = {
    "--hf-repo", "--hf-file", "--model-url", "--media-path", "--pooling", "--models-max",
    "--models-dir", "--mmproj-url", "--sleep-idle-seconds", "--lora", "--draft", "--model-draft",
    "--grp-attn-n", "--grp-attn-w", "--draft-max", "--draft-min", "--reasoning-budget",
}
DROP_ALONE = {"--offline", "--embedding", "--reranking", "--cont-batching", "--no-models-autoload"}


def main() -> None:
    given = sys.argv[1:]
    args = []
    i = 0
    while i < len(given):
        if given[i] in DROP_WITH_VALUE:
            i += 2
        elif given[i] in DROP_ALONE:
            i += 1
        else:
            args.append(given[i])
            i += 1
    args += os.environ.get("H2O_SERVER_ARGS", "").split()
    server = os.environ["H2O_SERVER"]
    os.execv(server, [server] + args)


if __name__ == "__main__":
    main()
