"""Errors of the model manager, each with a message a user can act on.

Every function of :mod:`engine.hub` that talks to the Hub raises a :class:`HubError`
subclass, never a raw ``httpx`` or ``huggingface_hub`` exception: the GUI shows
``str(error)`` as it is, and can branch on the class (offer a token field for
:class:`GatedRepoError`, a "Resume" button for :class:`DiskFullError`).
"""

from __future__ import annotations

import errno
from pathlib import Path

__all__ = [
    "DiskFullError",
    "DownloadCancelled",
    "FileNotOnHubError",
    "GatedRepoError",
    "HubError",
    "HubUnreachableError",
    "ModelValidationError",
    "RepoNotFoundError",
    "UnsupportedModelError",
    "VerificationError",
    "explain",
    "is_disk_full",
    "is_network_error",
]

UNREACHABLE = "the Hub cannot be reached: check your connection; local models still work"


class HubError(RuntimeError):
    """Something about the Hub or a download went wrong; ``str()`` says what and what to do."""


class HubUnreachableError(HubError):
    """No network, DNS failure, timeout, or the Hub is down."""


class RepoNotFoundError(HubError):
    pass


class FileNotOnHubError(HubError):
    pass


class GatedRepoError(HubError):
    """The repository needs a (valid) access token; ``repo_id`` names it."""

    def __init__(self, message: str, repo_id: str):
        super().__init__(message)
        self.repo_id = repo_id


class DiskFullError(HubError):
    """The disk filled up; the partial file (if any) is kept so that the download can resume."""

    def __init__(self, message: str, free_bytes: int | None = None, partial: Path | None = None):
        super().__init__(message)
        self.free_bytes = free_bytes
        self.partial = partial


class VerificationError(HubError):
    """Downloaded bytes did not match the Hub's hash; the file has been deleted."""


class UnsupportedModelError(HubError):
    """Folio cannot run this model (architecture, tensor type, split file)."""


class ModelValidationError(HubError):
    """A local file or folder is not a model Folio can load (import, listing)."""


class DownloadCancelled(HubError):
    """The user cancelled; the partial file is kept for a later resume."""


# Names of the exception classes that mean "the network failed", across httpx, httpx2
# (huggingface_hub >= 2), requests and the standard library. Matching by name keeps this
# module independent of which HTTP stack the installed huggingface_hub uses.
_NETWORK_ERROR_NAMES = frozenset(
    {
        "TransportError",  # httpx / httpx2: connect, read, write, protocol, proxy errors
        "TimeoutException",
        "ConnectionError",  # requests and builtins
        "Timeout",
        "ChunkedEncodingError",
        "TimeoutError",
        "OfflineModeIsEnabled",
    }
)


# A redirect loop, or an address the client will not fetch (file://, no scheme): the
# server's answer is wrong, which no retry can fix. httpx files UnsupportedProtocol
# under TransportError, so without this a file:// redirect read "cannot be reached".
_BAD_ADDRESS_NAMES = frozenset({"UnsupportedProtocol", "TooManyRedirects", "InvalidURL"})


def is_network_error(exc: BaseException) -> bool:
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & _NETWORK_ERROR_NAMES) and not names & _BAD_ADDRESS_NAMES


def _bad_address(exc: BaseException, what: str) -> HubError | None:
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "TooManyRedirects" in names:
        return HubError(
            f"{what}: the server redirects the request in a loop; the Hub or a proxy is "
            f"misconfigured: try again later, or check HF_ENDPOINT"
        )
    if names & _BAD_ADDRESS_NAMES:
        try:
            url = str(exc.request.url)  # type: ignore[attr-defined]
        except (AttributeError, RuntimeError):  # httpx raises RuntimeError when unset
            url = "an address"
        return HubError(
            f"{what}: the server sent the download to {url}, which is not a web address; "
            f"Folio downloads only over http(s): check HF_ENDPOINT, or report the repository"
        )
    return None


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1))


def explain(
    exc: BaseException, repo_id: str | None = None, filename: str | None = None
) -> HubError:
    """Translate an exception from huggingface_hub / the HTTP client into a :class:`HubError`."""
    if isinstance(exc, HubError):
        return exc
    from huggingface_hub import errors as hf

    what = f"{repo_id}/{filename}" if repo_id and filename else (repo_id or "the request")
    if (refused := _bad_address(exc, what)) is not None:
        return refused
    status = getattr(getattr(exc, "response", None), "status_code", None)
    # GatedRepoError subclasses RepositoryNotFoundError: test it first.
    if isinstance(exc, hf.GatedRepoError) or (status == 401 and isinstance(exc, hf.HfHubHTTPError)):
        return GatedRepoError(
            f"{repo_id or 'this repository'} is gated: accept its terms on the Hugging Face "
            f"website, then enter an access token (huggingface.co/settings/tokens)",
            repo_id or "",
        )
    if isinstance(exc, hf.RepositoryNotFoundError) or (status == 404 and filename is None):
        return RepoNotFoundError(
            f"repository {repo_id or ''} was not found on the Hub: check the name "
            f"(a private repository also needs an access token)".replace("  ", " ")
        )
    if isinstance(exc, hf.RevisionNotFoundError):
        return RepoNotFoundError(f"{what}: that revision does not exist on the Hub")
    if isinstance(exc, hf.RemoteEntryNotFoundError) or status == 404:
        return FileNotOnHubError(
            f"{filename or 'the file'} was not found in {repo_id or 'the repository'} on the Hub"
        )
    if isinstance(exc, hf.LocalEntryNotFoundError) or is_network_error(exc):
        return HubUnreachableError(UNREACHABLE)
    if isinstance(exc, hf.HfHubHTTPError):
        if status is not None and status >= 500:
            return HubUnreachableError(
                f"the Hub answered with an error ({status}); try again later; local models still work"
            )
        return HubError(f"the Hub refused {what} (HTTP {status})")
    if is_disk_full(exc):
        return DiskFullError(f"the disk is full while working on {what}")
    return HubError(f"{what}: {exc}")
