"""Declared licences of installed distributions, as SPDX license expressions.

Resolution order: the PEP 639 ``License-Expression`` field; a one-line
``License`` field that is already a valid SPDX expression or a well-known
alias of one; a single unambiguous trove classifier. Anything else is
``NOASSERTION`` (with the declared text kept as a comment), never a guess:
"BSD License" does not say which BSD.
"""

from __future__ import annotations

from plyx.governance._environment import Distribution

__all__ = ["declared_license"]

_ALIASES = {
    "apache 2.0": "Apache-2.0",
    "apache 2.0 license": "Apache-2.0",
    "apache license 2.0": "Apache-2.0",
    "apache license, version 2.0": "Apache-2.0",
    "apache-2": "Apache-2.0",
    "apache software license": "Apache-2.0",
    "mit license": "MIT",
    "the mit license": "MIT",
    "3-clause bsd license": "BSD-3-Clause",
    "bsd 3-clause": "BSD-3-Clause",
    "new bsd license": "BSD-3-Clause",
    "isc license": "ISC",
    "isc license (iscl)": "ISC",
    "mozilla public license 2.0 (mpl 2.0)": "MPL-2.0",
    "python software foundation license": "PSF-2.0",
}
_CLASSIFIER_PREFIX = "License :: OSI Approved :: "


def _validate(expression: str) -> str | None:
    """The normalized expression when every symbol is on the SPDX license list, else None."""
    from spdx_tools.common.spdx_licensing import spdx_licensing  # lazy: rdflib & co. load slowly

    try:
        info = spdx_licensing.validate(expression)
    except Exception:  # license-expression raises several unrelated types on garbage
        return None
    if info.errors or info.invalid_symbols or not info.normalized_expression:
        return None
    return str(info.normalized_expression)


def declared_license(dist: Distribution) -> tuple[str, str]:
    """(SPDX expression or ``NOASSERTION``, comment naming where it came from or what was declared)."""
    if dist.license_expression:
        found = _validate(dist.license_expression)
        if found:
            return found, "from License-Expression"
    text = dist.license_text
    if text and "\n" not in text and len(text) <= 200:
        alias = _ALIASES.get(text.lower())
        found = _validate(alias) if alias else _validate(text)
        if found:
            return found, "from the License field"
    mapped = {_ALIASES.get(c[len(_CLASSIFIER_PREFIX):].lower()) for c in dist.license_classifiers
              if c.startswith(_CLASSIFIER_PREFIX)}
    if len(dist.license_classifiers) == 1 and len(mapped) == 1 and None not in mapped:
        return str(mapped.pop()), "from the trove classifier"
    declared = dist.license_expression or (text.splitlines()[0] if text else "")
    if not declared and dist.license_classifiers:
        declared = "; ".join(dist.license_classifiers)
    if declared:
        return "NOASSERTION", f"declared as {declared[:200]!r}, not an SPDX expression"
    return "NOASSERTION", "no license declared in the distribution metadata"
