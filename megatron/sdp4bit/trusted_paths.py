"""Files and folders the trainer reads and then trusts: one rule, checked here.

The trainer and its tools act on what they read back from disk: megatron-core maps its
dataset index caches and indexes the data with them unchecked (a planted cache trains on
whatever samples it names), checkpoints become the weights, tokenizer files decide every
token id, the tracker picks the checkpoint, the CPU kernels' cache holds a library that
runs in every rank. Another local user who can write any of these controls the run.

[Note: the trust rule]
A path read and trusted (a folder, or a file and the folder holding it) must be

* owned by this user or by root;
* writable by nobody else: not by others, and not by its group unless that group is this
  user's private group (named after the user, with no other member: the convention under
  which Debian and Ubuntu give users a umask of 002, so the files megatron-core writes are
  group-writable and still nobody else's);
* a symbolic link only if this user (or root) made it; its target is then checked the same
  way. A link another user made is refused: it decides where the run reads and writes;
* a regular file or a folder (or a link to one): a FIFO, a socket or a device is refused
  without being opened, as reading one can block forever or never end.

The folder holding a checked path may also be a sticky folder such as ``/tmp`` (owned by
root or this user, writable by all, but nobody can rename or delete another's entries), as
long as the path itself passes. A path that fails is refused with one line naming it, what
is wrong and the fix; nothing falls back silently.

Files the trainer writes where it later reads them are never opened through a link: the run
lock with ``O_NOFOLLOW | O_CREAT``, everything else under a fresh temporary name
(``O_CREAT | O_EXCL | O_NOFOLLOW``) renamed into place, and a rename replaces a link
instead of writing through it (:func:`open_new`, :func:`refuse_link`).

Where the rule is applied: ``--save``, ``--load`` (the tracker, the checkpoint folder and
every file in it, before anything is read), ``--data-cache-path`` or
``<prefix>/cache/GPTDataset_indices`` and every cache file in it, the tokenizer files (all
in :mod:`megatron.sdp4bit.training.guards.preflight`,
:mod:`megatron.sdp4bit.training.tokenizers.registry` and
:mod:`megatron.sdp4bit.training.checkpoint.formats`), ``tools/checkpoint/export_hf.py``'s
checkpoint and the tokenizer files it ships, ``tools/checkpoint/import_hf.py``'s folder, and
the CPU kernels' cache (``quantization/cpu_kernels.py``, stricter: no link
at all, and the library checked is the descriptor loaded). The data files (``.bin``/``.idx``)
are not held to it: datasets are commonly shared read-only, and the preflight checks every
value in them instead.

This module imports nothing from the rest of the package: every layer may use it.
"""

from __future__ import annotations

import functools
import os
import stat


class UntrustedPathError(ValueError):
    """A path another user could have written or redirected; one line with the fix."""


@functools.lru_cache(maxsize=None)
def _private_group(gid: int, uid: int) -> bool:
    """Whether ``gid`` is the private group of user ``uid``: named after it, its primary
    group, and no other user's group (listed member or primary)."""
    import grp
    import pwd

    try:
        user, group = pwd.getpwuid(uid), grp.getgrgid(gid)
    except KeyError:
        return False
    if group.gr_name != user.pw_name or user.pw_gid != gid:
        return False
    if set(group.gr_mem) - {user.pw_name}:
        return False
    try:
        return all(p.pw_uid == uid or p.pw_gid != gid for p in pwd.getpwall())
    except OSError:
        return False


def stat_problem(st: os.stat_result) -> str | None:
    """What makes a file or folder with status ``st`` untrustworthy, as the middle of a
    sentence ("belongs to uid 65534, not to this user (uid 0)"), or None."""
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        return f"belongs to uid {st.st_uid}, not to this user (uid {uid})"
    writable = st.st_mode & stat.S_IWOTH or (
        st.st_mode & stat.S_IWGRP and not _private_group(st.st_gid, uid))
    if writable:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _holder_problem(st: os.stat_result) -> str | None:
    """:func:`stat_problem` for the folder holding a checked path: a sticky folder of root
    or this user (``/tmp``) is fine, as nobody can replace another user's entry in it."""
    if st.st_mode & stat.S_ISVTX and st.st_uid in (os.geteuid(), 0):
        return None
    return stat_problem(st)


def problem(path: str, what: str) -> str | None:
    """Why ``path`` (described as ``what``, e.g. ``--data-cache-path``) breaks the trust rule,
    as a sentence without the fix, or None when it keeps it (or does not exist)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None  # missing or unreachable: whoever opens it names the error
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid not in (os.geteuid(), 0):
            return (f"{what} {path} is a symbolic link made by uid {st.st_uid}, not by this "
                    f"user (uid {os.geteuid()})")
        target = os.path.realpath(path)
        try:
            st = os.stat(target)
        except OSError:
            return None  # a dangling link of this user's: whoever reads it names the error
        if (found := stat_problem(st)) is not None:
            return f"{what} {path} (a link to {target}) {found}"
        path = target
    elif (found := stat_problem(st)) is not None:
        return f"{what} {path} {found}"
    holder = os.path.dirname(os.path.abspath(path)) or "/"
    try:
        found = _holder_problem(os.stat(holder))
    except OSError:
        found = None
    if found is not None:
        return f"the folder {holder} holding {what} {path} {found}"
    return None


def kind(st: os.stat_result) -> str:
    """What kind of file ``st`` describes, as a noun phrase ("a FIFO")."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(st.st_mode):
            return name
    return "a special file"


def kind_problem(path: str, what: str) -> str | None:
    """The refusal of ``path`` when it is (or links to) neither a regular file nor a folder:
    a FIFO, a socket or a device is never opened (reading one can block forever or never
    end); None otherwise, or when it does not exist."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return None
    return (f"{what} {path} is {kind(st)}, not a regular file: refused without opening it; "
            "remove it")


def check(path: str, what: str, fix: str) -> None:
    """Raise :class:`UntrustedPathError` (``"<problem>: refused; <fix>"``) when ``path``
    breaks the trust rule, or is neither a regular file nor a folder
    (:func:`kind_problem`)."""
    found = kind_problem(path, what)
    if found is not None:
        raise UntrustedPathError(found)
    found = problem(path, what)
    if found is not None:
        raise UntrustedPathError(f"{found}: refused, another user could change what the run "
                                 f"reads; {fix}")


def check_tree(folder: str, what: str, fix: str) -> None:
    """:func:`check` for ``folder`` and every file and folder under it (links are checked,
    not descended into)."""
    check(folder, what, fix)
    for parent, dirs, names in os.walk(folder):
        for name in sorted(dirs + names):
            check(os.path.join(parent, name), f"a file of {what}", fix)


def check_with_entries(path: str, what: str, fix: str, entry_fix: str) -> None:
    """:func:`check` for ``path`` and, when it is a folder, every entry in it (``a file of
    <what>``; links checked, folders not descended into): a tokenizer's file or folder."""
    check(path, what, fix)
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            check(os.path.join(path, name), f"a file of {what}", entry_fix)


def refuse_link(path: str, what: str) -> None:
    """Raise :class:`UntrustedPathError` when ``path`` is a symbolic link: the run is about to
    write it, and a write would follow the link out of the folder."""
    if os.path.islink(path):
        raise UntrustedPathError(
            f"{what} {path} is a symbolic link (to {os.readlink(path)}): refused, a write "
            "would follow it out of its folder; delete the link")


def open_new(path: str, mode: int = 0o644) -> int:
    """A descriptor of a new file ``path`` for writing: a stale file of that name is removed
    first (a link is removed, not followed), and the open neither follows a link nor reuses
    a file someone created in between."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                   mode)
