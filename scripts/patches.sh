#!/usr/bin/env bash
# Maintains our changes to llama.cpp (see patches/README.md): the H2O source files in engine/ and
# the hook series in patches/.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: scripts/patches.sh <command> [args]

Maintains engine/ (the H2O source files, copied into llama.cpp's tree at the same paths) and
patches/ (the hooks: the series applied, in the order of patches/series, to upstream's files),
over the pristine llama.cpp shipped in the llama-cpp-sys-2 crate pinned by
vendor/pin/Cargo.{toml,lock}.

commands:
  apply <dir>         Vendor the pinned pristine llama.cpp into <dir> (must not exist, or be
                      empty), make it a git repository whose first commit (tag `h2o-base`) is
                      the pristine tree, whose second (tag `h2o-engine`) adds engine/'s files,
                      and `git am --3way` every hook of the series on top, one commit per hook.
                      Edit there, commit, then `regenerate`.
  regenerate <dir>    Rewrite engine/ from the files <dir> (a tree made by `apply`) adds to
                      `h2o-base`, and patches/*.patch and patches/series from the commits after
                      `h2o-engine`, limited to upstream's files. One commit = one hook.
  check               Verify that engine/'s files add to the pinned pristine llama.cpp without
                      replacing any of its files and that every hook of the series applies, in
                      order, after them (in a temporary copy). Exits non-zero naming the first
                      file or hook that does not.
  bump <version>      Move the pin to llama-cpp-sys-2 <version> (vendor/pin/Cargo.toml and the
                      checksum in vendor/pin/Cargo.lock), then `apply` the series onto it in
                      target/patch-bump-<version> and say what to do next. That tree also holds
                      the old pristine tree (tag `h2o-prev-base`), so that `git am --3way`
                      merges with conflict markers instead of just refusing.
  -h, --help          This text.

Environment: CARGO (default `cargo`), TMPDIR (temporary files, default /tmp).
EOF
}

ORIG_PWD=$PWD
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd -P)

CARGO=${CARGO:-cargo}
CRATE=llama-cpp-sys-2
BASE_TAG=h2o-base
ENGINE_TAG=h2o-engine
SERIES_HEADER="# Patch series applied, in order, to the pinned llama.cpp (see patches/README.md)."
# Fixed identity, so that a fresh machine without a git identity can still make the trees.
BOT_NAME="h2o-llama patches"
BOT_EMAIL="patches@h2o-llama.invalid"

# Never let the caller's environment redirect our git commands to another repository.
unset GIT_DIR GIT_WORK_TREE GIT_INDEX_FILE GIT_OBJECT_DIRECTORY GIT_COMMON_DIR

die() { echo "patches.sh: $*" >&2; exit 1; }

# Absolute form of a path given relative to the caller's working directory.
abspath() {
    case $1 in
        /*) printf '%s\n' "$1" ;;
        *) printf '%s\n' "$ORIG_PWD/$1" ;;
    esac
}

# git in <dir>, never discovering a repository above it.
git_in() {
    local dir=$1
    shift
    GIT_CEILING_DIRECTORIES=$(dirname "$dir") git -C "$dir" "$@"
}

# One temporary directory per run, removed on exit. Made here, in the main shell, because
# helpers run inside $(...) subshells, whose variables and traps do not reach back here.
APPLY_CONFLICT=0
WORK=$(mktemp -d "${TMPDIR:-/tmp}/h2o-patches.XXXXXX")
[ -n "$WORK" ] && [ -d "$WORK" ] || { echo "patches.sh: cannot make a temporary directory" >&2; exit 1; }
trap 'rm -rf "$WORK"' EXIT

# field <name> of the llama-cpp-sys-2 entry in vendor/pin/Cargo.lock
pinned_field() {
    awk -v crate="$CRATE" -v key="$1" '
        /^\[\[package\]\]/ { inpkg = 0 }
        $1 == "name" && $3 == "\"" crate "\"" { inpkg = 1 }
        inpkg && $1 == key { gsub(/"/, "", $3); print $3; exit }
    ' "$ROOT/vendor/pin/Cargo.lock"
}

pinned_version() {
    local v
    v=$(pinned_field version)
    [ -n "$v" ] || die "vendor/pin/Cargo.lock does not pin $CRATE"
    printf '%s\n' "$v"
}

# Vendors the pinned crate into the temp dir; prints the path of its pristine llama.cpp/.
vendor_pristine() {
    local version checksum crate_dir found
    version=$(pinned_version)
    checksum=$(pinned_field checksum)
    echo "== vendoring pristine $CRATE $version" >&2
    # --locked: cargo verifies the download against Cargo.lock's checksum (as build/source.rs does).
    if ! env -u CARGO_TARGET_DIR "$CARGO" vendor --locked --versioned-dirs --quiet \
            --manifest-path "$ROOT/vendor/pin/Cargo.toml" "$WORK/vendor-$version" >/dev/null; then
        die "\`$CARGO vendor\` of the pinned $CRATE $version failed"
    fi
    crate_dir="$WORK/vendor-$version/$CRATE-$version"
    found=$(grep -o '"package":"[0-9a-f]*"' "$crate_dir/.cargo-checksum.json" | cut -d'"' -f4 || true)
    [ "$found" = "$checksum" ] || die "vendored $CRATE $version has checksum '$found', pinned '$checksum'"
    [ -f "$crate_dir/llama.cpp/include/llama.h" ] || die "$crate_dir has no llama.cpp/include/llama.h"
    printf '%s\n' "$crate_dir/llama.cpp"
}

# The ordered patch names from patches/series (blank lines and `#` comments ignored, as build/patches.rs).
series_names() {
    sed -e 's/#.*//' -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' "$ROOT/patches/series" | grep -v '^$' || true
}

# add_engine <dir>: copies engine/'s files into <dir> at the same paths; none may replace a file
# the tree already has (upstream's files change through hooks only).
add_engine() {
    local dir=$1 f
    [ -d "$ROOT/engine" ] || die "engine/ does not exist"
    while IFS= read -r f; do
        [ ! -e "$dir/$f" ] || die "engine/$f would replace upstream's $f; change it through a hook instead"
        mkdir -p "$dir/$(dirname "$f")"
        cp "$ROOT/engine/$f" "$dir/$f"
    done < <(cd "$ROOT/engine" && find . -type f | sed 's|^\./||' | LC_ALL=C sort)
}

plural() { if [ "$1" = 1 ]; then echo "$1 $2"; else echo "$1 ${2}es"; fi; }

# ---------------------------------------------------------------------------------------------

# do_apply <dir> [<previous pristine llama.cpp>]
# Sets APPLY_CONFLICT=1 when `git am` stopped on a conflict (after explaining how to go on).
# It is not called in a `||` context (which would turn off `set -e` inside it): errors exit.
# With a previous pristine tree (bump), its files are recorded too, as the commit tagged
# h2o-prev-base outside the branch: the patches were made against those blobs, and
# `git am --3way` needs them to merge instead of just failing.
do_apply() {
    local dir=$1 prev=${2:-} pristine version names=() n i next prev_tree prev_commit
    if [ -e "$dir" ] && { [ ! -d "$dir" ] || [ -n "$(ls -A "$dir")" ]; }; then
        die "$dir exists and is not an empty directory; choose another (or remove it)"
    fi
    version=$(pinned_version)
    mapfile -t names < <(series_names)
    for n in "${names[@]}"; do
        [ -f "$ROOT/patches/$n" ] || die "patches/series names $n, which does not exist"
    done
    pristine=$(vendor_pristine)
    [ -n "$pristine" ] && [ -d "$pristine" ] || die "no pristine tree"

    echo "== copying pristine llama.cpp to $dir" >&2
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd -P)
    cp -a "$pristine/." "$dir/"

    git_in "$dir" -c init.defaultBranch=main init -q
    # Give the tree a local identity only when the user has none, so `git am --continue` and
    # their own commits work on a fresh machine too.
    if [ -z "$(git_in "$dir" config user.email || true)" ]; then
        git_in "$dir" config user.name "$BOT_NAME"
        git_in "$dir" config user.email "$BOT_EMAIL"
    fi
    # -f: upstream's .gitignore must not keep shipped files out of the base commit.
    git_in "$dir" add -A -f .
    git_in "$dir" -c user.name="$BOT_NAME" -c user.email="$BOT_EMAIL" -c commit.gpgSign=false \
        commit -q --no-verify -m "pristine $CRATE $version"
    git_in "$dir" tag "$BASE_TAG"
    echo "== base commit tagged $BASE_TAG: pristine $CRATE $version" >&2
    if [ -n "$prev" ]; then
        prev_tree=$(GIT_INDEX_FILE="$dir/.git/h2o-prev-index" git_in "$dir" --work-tree="$prev" add -A -f . \
            && GIT_INDEX_FILE="$dir/.git/h2o-prev-index" git_in "$dir" write-tree)
        rm -f "$dir/.git/h2o-prev-index"
        prev_commit=$(git_in "$dir" -c user.name="$BOT_NAME" -c user.email="$BOT_EMAIL" \
            commit-tree -m "previous pristine (for git am --3way only)" "$prev_tree")
        git_in "$dir" tag h2o-prev-base "$prev_commit"
        echo "== previous pristine recorded as tag h2o-prev-base (for 3-way merges)" >&2
    fi

    add_engine "$dir"
    git_in "$dir" add -A -f .
    git_in "$dir" -c user.name="$BOT_NAME" -c user.email="$BOT_EMAIL" -c commit.gpgSign=false \
        commit -q --no-verify --allow-empty -m "H2O source files (engine/)"
    git_in "$dir" tag "$ENGINE_TAG"
    echo "== engine/ added, tagged $ENGINE_TAG" >&2

    if [ ${#names[@]} -eq 0 ]; then
        echo "patches/series is empty: $dir is the pristine tree plus engine/ at $ENGINE_TAG" >&2
        return
    fi
    local files=()
    for n in "${names[@]}"; do files+=("$ROOT/patches/$n"); done
    echo "== applying $(plural ${#names[@]} patch) with git am --3way" >&2
    if ! git_in "$dir" -c commit.gpgSign=false am --3way --whitespace=nowarn "${files[@]}"; then
        next=$(cat "$dir/.git/rebase-apply/next" 2>/dev/null || echo "?")
        n="?"
        if [[ $next =~ ^[0-9]+$ ]] && [ "$next" -ge 1 ] && [ "$next" -le ${#names[@]} ]; then
            n=${names[$((next - 1))]}
        fi
        cat >&2 <<EOF

patches.sh: patch $n (number $next of ${#names[@]} in patches/series) does not apply
cleanly to $CRATE $version. To recover:
  1. cd $dir and resolve the conflicts: \`git status\` lists them, with conflict markers in the
     files (where git could not merge at all, \`git am --show-current-patch=diff\` shows the change
     to redo by hand); then \`git add\` the resolved files;
  2. git am --continue      (applies the remaining patches; repeat 1-2 on further conflicts;
                              \`git am --skip\` drops a patch that upstream has merged);
  3. scripts/patches.sh regenerate $dir
EOF
        APPLY_CONFLICT=1
        return
    fi
    i=$(git_in "$dir" rev-list --count "$ENGINE_TAG..HEAD")
    echo "applied engine/ and $(plural "$i" patch) on $CRATE $version in $dir" >&2
}

cmd_apply() {
    [ $# -eq 1 ] || { usage >&2; exit 2; }
    do_apply "$(abspath "$1")"
    [ "$APPLY_CONFLICT" = 0 ] || exit 2
}

cmd_regenerate() {
    [ $# -eq 1 ] || { usage >&2; exit 2; }
    local dir base_msg version untracked n old_names=() new_names=() changes=0
    dir=$(abspath "$1")
    [ -d "$dir/.git" ] || die "$dir is not a git tree made by \`scripts/patches.sh apply\`"
    dir=$(cd "$dir" && pwd -P)
    git_in "$dir" rev-parse -q --verify "refs/tags/$BASE_TAG" >/dev/null \
        || die "$dir has no tag $BASE_TAG (make it with \`scripts/patches.sh apply\`)"
    git_in "$dir" rev-parse -q --verify "refs/tags/$ENGINE_TAG" >/dev/null \
        || die "$dir has no tag $ENGINE_TAG (make it with \`scripts/patches.sh apply\`)"
    if [ -d "$dir/.git/rebase-apply" ] || [ -d "$dir/.git/rebase-merge" ]; then
        die "a git am/rebase is in progress in $dir; finish it (git am --continue) first"
    fi
    if [ -n "$(git_in "$dir" status --porcelain --untracked-files=no)" ]; then
        die "$dir has uncommitted changes; commit them (one commit per patch) first"
    fi
    untracked=$(git_in "$dir" ls-files --others --exclude-standard)
    if [ -n "$untracked" ]; then
        echo "patches.sh: warning: untracked files in $dir are neither in engine/ nor in a hook:" >&2
        printf '  %s\n' $untracked | head -20 >&2
    fi
    version=$(pinned_version)
    base_msg=$(git_in "$dir" log -1 --format=%s "$BASE_TAG")
    [ "$base_msg" = "pristine $CRATE $version" ] \
        || die "$dir is based on '$base_msg' but the pin is $CRATE $version"
    if [ -n "$(git_in "$dir" rev-list --merges "$BASE_TAG..HEAD")" ]; then
        die "$BASE_TAG..HEAD in $dir contains merge commits; make the history linear first"
    fi

    # engine/: every file the tree adds to upstream's, as HEAD has it
    local added=() upstream=() f engine_changes
    mapfile -t added < <(git_in "$dir" diff --name-only --no-renames --diff-filter=A "$BASE_TAG" HEAD)
    mapfile -t upstream < <(git_in "$dir" diff --name-only --no-renames --diff-filter=MDT "$BASE_TAG" HEAD)
    mkdir -p "$WORK/engine"
    for f in "${added[@]}"; do
        mkdir -p "$WORK/engine/$(dirname "$f")"
        git_in "$dir" show "HEAD:$f" >"$WORK/engine/$f"
    done
    engine_changes=$(diff -rq "$ROOT/engine" "$WORK/engine" 2>/dev/null | sed -E \
        -e "s|^Files $ROOT/(engine/[^ ]*) and .* differ$|changed   \\1|" \
        -e "s|^Only in $WORK/engine/?([^:]*): (.*)$|added     engine/\\1/\\2|" \
        -e "s|^Only in $ROOT/engine/?([^:]*): (.*)$|removed   engine/\\1/\\2|" -e "s|engine//|engine/|" || true)
    rm -rf "$ROOT/engine"
    cp -a "$WORK/engine" "$ROOT/engine"
    if [ -n "$engine_changes" ]; then
        sed 's/^/  /' <<<"$engine_changes"
        changes=1
    fi

    mkdir -p "$WORK/old"
    mapfile -t old_names < <(cd "$ROOT/patches" && ls -1 -- *.patch 2>/dev/null || true)
    for n in "${old_names[@]}"; do cp "$ROOT/patches/$n" "$WORK/old/"; done
    cp "$ROOT/patches/series" "$WORK/old/series"

    rm -f "$ROOT"/patches/*.patch
    # The -c settings pin the output format against the user's git configuration
    # (a:/b: prefixes are what `git apply -p1` in build/patches.rs expects). The hooks are the
    # commits after the engine's, limited to upstream's files: engine/ holds the rest.
    if [ ${#upstream[@]} -gt 0 ]; then
        git_in "$dir" -c diff.noprefix=false -c diff.mnemonicPrefix=false -c format.suffix=.patch \
            -c format.coverLetter=false -c format.signature= \
            format-patch -q --zero-commit --no-signature --no-numbered \
            -o "$ROOT/patches" "$ENGINE_TAG..HEAD" -- "${upstream[@]}" >/dev/null
    fi
    mapfile -t new_names < <(cd "$ROOT/patches" && ls -1 -- *.patch 2>/dev/null || true)
    {
        echo "$SERIES_HEADER"
        for n in "${new_names[@]}"; do echo "$n"; done
    } >"$ROOT/patches/series"

    for n in "${old_names[@]}"; do
        if [ ! -f "$ROOT/patches/$n" ]; then echo "  removed   patches/$n"; changes=1; fi
    done
    for n in "${new_names[@]}"; do
        if [ ! -f "$WORK/old/$n" ]; then
            echo "  added     patches/$n"; changes=1
        elif ! cmp -s "$WORK/old/$n" "$ROOT/patches/$n"; then
            echo "  changed   patches/$n"; changes=1
        fi
    done
    if ! cmp -s "$WORK/old/series" "$ROOT/patches/series"; then
        echo "  changed   patches/series"; changes=1
    fi
    if [ "$changes" = 0 ]; then
        echo "engine/ and patches/ unchanged (${#added[@]} files, $(plural ${#new_names[@]} patch) from $dir)"
    else
        echo "engine/ and patches/ regenerated: ${#added[@]} files, $(plural ${#new_names[@]} patch) from $dir"
        echo "next: scripts/patches.sh check; if a public header changed, scripts/update-bindings.sh"
    fi
}

cmd_check() {
    [ $# -eq 0 ] || { usage >&2; exit 2; }
    local version pristine tree names=() n i=0 err f
    version=$(pinned_version)
    mapfile -t names < <(series_names)
    pristine=$(vendor_pristine)
    [ -n "$pristine" ] && [ -d "$pristine" ] || die "no pristine tree"
    tree="$WORK/tree"
    cp -a "$pristine" "$tree"
    add_engine "$tree"
    echo "  ok  engine/ ($(cd "$ROOT/engine" && find . -type f | wc -l) files, none of upstream's replaced)" >&2
    for n in "${names[@]}"; do
        i=$((i + 1))
        f="$ROOT/patches/$n"
        [ -f "$f" ] || die "patch $i of the series, $n, does not exist"
        if ! err=$(git_in "$tree" apply --check --whitespace=nowarn -p1 "$f" 2>&1) \
            || ! err=$(git_in "$tree" apply --whitespace=nowarn -p1 "$f" 2>&1); then
            printf '%s\n' "$err" >&2
            if [ "$i" = 1 ]; then
                die "patch 1 of the series, $n, does not apply to pristine $CRATE $version"
            fi
            die "patch $i of the series, $n, does not apply to $CRATE $version after the $((i - 1)) before it"
        fi
        echo "  ok  $n" >&2
    done
    # *.patch files not in the series are never applied: probably a forgotten series entry.
    for f in "$ROOT"/patches/*.patch; do
        [ -e "$f" ] || continue
        n=$(basename "$f")
        printf '%s\n' "${names[@]}" | grep -qxF -- "$n" \
            || echo "patches.sh: warning: patches/$n is not listed in patches/series" >&2
    done
    if [ ${#names[@]} = 1 ]; then
        echo "engine/ and 1 patch apply cleanly to $CRATE $version"
    else
        echo "engine/ and ${#names[@]} patches apply cleanly to $CRATE $version"
    fi
}

cmd_bump() {
    [ $# -eq 1 ] || { usage >&2; exit 2; }
    local new=$1 old dir toml="$ROOT/vendor/pin/Cargo.toml"
    [[ $new =~ ^[0-9]+\.[0-9]+\.[0-9]+([-+][0-9A-Za-z.+-]+)?$ ]] || die "not a version: $new"
    old=$(pinned_version)
    [ "$new" != "$old" ] || die "$CRATE is already pinned at $new"
    dir="$ROOT/target/patch-bump-$new"
    if [ -e "$dir" ] && { [ ! -d "$dir" ] || [ -n "$(ls -A "$dir")" ]; }; then
        die "$dir already exists; remove it first"
    fi
    grep -Eq "^$CRATE = \{ version = \"=[^\"]+\"" "$toml" \
        || die "cannot find the \`$CRATE = { version = \"=...\"\` line in vendor/pin/Cargo.toml"
    # The current pristine tree: the patches' preimages, for 3-way merges onto the new one.
    local prev
    prev=$(vendor_pristine)
    [ -n "$prev" ] && [ -d "$prev" ] || die "no pristine tree"

    cp "$toml" "$WORK/Cargo.toml.orig"
    cp "$ROOT/vendor/pin/Cargo.lock" "$WORK/Cargo.lock.orig"
    sed -E -i "s/^($CRATE = \\{ version = \")=[^\"]+\"/\\1=$new\"/" "$toml"
    echo "== pin: $CRATE $old -> $new; refreshing vendor/pin/Cargo.lock (undo: git checkout vendor/pin)" >&2
    if ! env -u CARGO_TARGET_DIR "$CARGO" update --manifest-path "$toml" -p "$CRATE" --precise "$new"; then
        cp "$WORK/Cargo.toml.orig" "$toml"
        cp "$WORK/Cargo.lock.orig" "$ROOT/vendor/pin/Cargo.lock"
        die "cargo update to $CRATE $new failed; vendor/pin restored"
    fi
    [ "$(pinned_version)" = "$new" ] || die "vendor/pin/Cargo.lock does not pin $new after cargo update"

    do_apply "$dir" "$prev"
    cat >&2 <<EOF

Pin moved to $CRATE $new (vendor/pin/Cargo.toml, vendor/pin/Cargo.lock). Next:
  1. in $dir: fix any conflicts (see above) and finish \`git am\`;
     drop patches that upstream has merged (\`git am --skip\` while one stops, or
     \`git rebase -i $ENGINE_TAG\` afterwards); an engine/ file that upstream now has too stops
     the apply: rename ours, or fold it into a hook;
  2. scripts/patches.sh regenerate $dir
  3. scripts/update-bindings.sh        (the public headers will have changed)
  4. cargo test (which also compiles engine/'s files against the new headers), and update the
     table in patches/README.md; commit vendor/pin, engine/, patches/ and src/sys together.
To abandon the bump: git checkout vendor/pin && rm -rf $dir
EOF
    [ "$APPLY_CONFLICT" = 0 ] || exit 2
}

case ${1:-} in
    apply) shift; cmd_apply "$@" ;;
    regenerate) shift; cmd_regenerate "$@" ;;
    check) shift; cmd_check "$@" ;;
    bump) shift; cmd_bump "$@" ;;
    -h | --help) usage ;;
    "") usage; exit 2 ;;
    *) echo "patches.sh: unknown command: $1" >&2; usage >&2; exit 2 ;;
esac
