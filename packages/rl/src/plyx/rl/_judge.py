"""``plyx rl judge``: rank models from pairwise LLM-judge verdicts (Bradley-Terry), with a position-bias check.

Verdicts are JSONL records ``{"model_a": ..., "model_b": ..., "winner": ...}`` where ``model_a`` is the answer the
judge saw first; ``winner`` is ``model_a`` / ``a``, ``model_b`` / ``b``, one of the two model names, or a tie
(``tie``, ``tie (bothbad)``, ``tie (bothgood)``: Chatbot Arena's spellings). An optional ``question_id`` (or
``prompt``) pairs the two orders of one comparison for the flip rate. Verdicts can also be collected from a
judge model behind an OpenAI-compatible server (``plyx serve``): every pair of answers to every question is
judged in both orders with MT-Bench's pairwise prompt (Zheng et al. 2023), ``[[A]]`` / ``[[B]]`` / ``[[C]]``.

The model (Bradley & Terry 1952): ``P(i beats j) = sigmoid(theta_i - theta_j)``. A tie counts as half a win for
each side (the usual treatment, e.g. Chatbot Arena's Elo and FastChat's BT fit): ``W_ij`` = wins of i over j
+ ties / 2, ``N_ij`` = comparisons of i and j. ``prior`` adds that many pseudo-ties between every two models
(Laplace smoothing): it keeps strengths finite when a model wins or loses every game, and shrinks little
once there are many verdicts. The maximum-likelihood ``theta`` is found by Newton's method on the logistic
log-likelihood ``sum W_ij log sigmoid(theta_i - theta_j)`` (its Hessian is a graph Laplacian; the
constant direction is removed by centring, ``mean(theta) = 0``). Reported on the Elo scale too:
``1000 + 400 / ln(10) * theta``. Confidence intervals: the percentile bootstrap over verdicts (resampled
with replacement, ``bootstrap`` refits).

Position bias: ``first_position_win_rate`` = share of decisive verdicts won by the answer shown first, with a
Wilson interval (0.5 for an unbiased judge when every pair is judged in both orders; ``biased`` when the
interval excludes 0.5); ``flip_rate`` = share of comparisons judged in both orders whose winner changes
with the order (a tie on one side and a win on the other counts as a flip).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from plyx.rl._data import DataError, read_jsonl

__all__ = ["JUDGE_SYSTEM_PROMPT", "JudgeRanking", "Verdict", "collect_verdicts", "configure_judge", "elo",
           "fit_bradley_terry", "judge_prompt", "parse_verdict", "position_bias", "rank_models", "read_verdicts",
           "run_judge"]

_TIES = ("tie", "tie (bothbad)", "tie (bothgood)")
ELO_SCALE = 400.0 / math.log(10.0)

#: MT-Bench's pairwise judge prompt (FastChat ``judge_prompts.jsonl``, "pair-v2")
JUDGE_SYSTEM_PROMPT = (
    "Please act as an impartial judge and evaluate the quality of the responses provided by two AI assistants to "
    "the user question displayed below. You should choose the assistant that follows the user's instructions and "
    "answers the user's question better. Your evaluation should consider factors such as the helpfulness, "
    "relevance, accuracy, depth, creativity, and level of detail of their responses. Begin your evaluation by "
    "comparing the two responses and provide a short explanation. Avoid any position biases and ensure that the "
    "order in which the responses were presented does not influence your decision. Do not allow the length of the "
    "responses to influence your evaluation. Do not favor certain names of the assistants. Be as objective as "
    "possible. After providing your explanation, output your final verdict by strictly following this format: "
    '"[[A]]" if assistant A is better, "[[B]]" if assistant B is better, and "[[C]]" for a tie.'
)


def judge_prompt(question: str, answer_a: str, answer_b: str) -> str:
    """The user message of one pairwise judgement (MT-Bench's layout)."""
    return (f"[User Question]\n{question}\n\n[The Start of Assistant A's Answer]\n{answer_a}\n"
            f"[The End of Assistant A's Answer]\n\n[The Start of Assistant B's Answer]\n{answer_b}\n"
            "[The End of Assistant B's Answer]")


_VERDICT = re.compile(r"\[\[\s*([ABC])\s*\]\]")


def parse_verdict(text: str) -> str | None:
    """``"a"``, ``"b"``, ``"tie"`` from the judge's reply (its last ``[[A]]``/``[[B]]``/``[[C]]``), or None."""
    found = _VERDICT.findall(text or "")
    if not found:
        return None
    return {"A": "a", "B": "b", "C": "tie"}[found[-1]]


@attrs.frozen
class Verdict:
    """One judgement: ``model_a`` was shown first; ``winner`` is ``a``, ``b`` or ``tie``."""

    model_a: str
    model_b: str
    winner: str
    key: str | None = None
    line: int = 0


def read_verdicts(path: str | os.PathLike[str], models: Sequence[str] | None = None) -> list[Verdict]:
    """The verdicts of a JSONL file, checked.

    Args:
        path: the file.
        models: the models to rank (None: every model the file names); a verdict naming another is an error.

    Raises:
        DataError: an empty file, a missing field, an unknown winner, a winner naming neither model, a model
            judged against itself, or a model not in ``models``; the message names the line and the fix.
    """
    allowed = set(models) if models else None
    out = []
    for number, rec in read_jsonl(path):
        where = f"{path}:{number}"
        for field in ("model_a", "model_b", "winner"):
            if not isinstance(rec.get(field), str) or not rec[field]:
                raise DataError(f"{where}: a verdict needs a non-empty string {field!r} (has "
                                f"{', '.join(sorted(rec)) or 'no fields'}); write "
                                '{"model_a": ..., "model_b": ..., "winner": "model_a" | "model_b" | "tie"}')
        a, b, w = rec["model_a"], rec["model_b"], rec["winner"].strip()
        if a == b:
            raise DataError(f"{where}: model {a!r} is judged against itself; drop the record")
        if allowed is not None:
            for name in (a, b):
                if name not in allowed:
                    raise DataError(f"{where}: model {name!r} is not among the models to rank "
                                    f"({', '.join(sorted(allowed))}); add it to --models or drop the record")
        low = w.lower()
        if low in ("model_a", "a") or w == a:
            winner = "a"
        elif low in ("model_b", "b") or w == b:
            winner = "b"
        elif low in _TIES:
            winner = "tie"
        else:
            raise DataError(f"{where}: winner {w!r} names neither model of this verdict (model_a {a!r}, model_b "
                            f"{b!r}); write model_a, model_b, one of the two names, or tie")
        key = rec.get("question_id", rec.get("prompt"))
        out.append(Verdict(a, b, winner, None if key is None else json.dumps(key, sort_keys=True), number))
    if not out:
        raise DataError(f"{path}: no verdicts (the file is empty); judge some pairs first, or collect them with "
                        "--collect ANSWERS --base-url URL --judge-model NAME")
    return out


def _encode(verdicts: Sequence[Verdict], index: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(first model [n], second model [n], first model's score [n])``: 1 win, 0 loss, 0.5 tie."""
    ia = torch.tensor([index[v.model_a] for v in verdicts])
    ib = torch.tensor([index[v.model_b] for v in verdicts])
    score_a = torch.tensor([{"a": 1.0, "b": 0.0, "tie": 0.5}[v.winner] for v in verdicts], dtype=torch.float64)
    return ia, ib, score_a


def _counts(encoded: tuple[torch.Tensor, torch.Tensor, torch.Tensor], M: int, weights: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``W [M, M]`` (wins + ties / 2 of row over column) and ``N [M, M]`` (comparisons) as float64."""
    ia, ib, score_a = encoded
    w = torch.ones(ia.shape[0], dtype=torch.float64) if weights is None else weights.to(torch.float64)
    W = torch.zeros(M * M, dtype=torch.float64)
    W.index_add_(0, ia * M + ib, w * score_a)
    W.index_add_(0, ib * M + ia, w * (1 - score_a))
    W = W.view(M, M)  # (M, M)
    return W, W + W.T


def fit_bradley_terry(W: torch.Tensor, *, prior: float = 0.1, tol: float = 1e-10, max_iter: int = 100) -> torch.Tensor:
    """Centred maximum-likelihood strengths ``theta [M]`` from win counts ``W [M, M]`` (ties as half-wins).

    Args:
        W: ``W[i, j]`` = wins of i over j (+ half the ties).
        prior: pseudo-ties added between every two models (0: none; then every model must win and lose).
        tol: stop when the largest Newton step is below this.
        max_iter: at most this many Newton steps.
    """
    M = W.shape[0]
    W = W.to(torch.float64) + (prior / 2) * (1 - torch.eye(M, dtype=torch.float64))
    N = W + W.T
    theta = torch.zeros(M, dtype=torch.float64)
    for _ in range(max_iter):
        s = torch.sigmoid(theta[:, None] - theta[None, :])  # (M, M): P(i beats j)
        grad = (W - N * s).sum(1)  # d logL / d theta_i
        c = N * s * s.T  # (M, M): N_ij s_ij s_ji
        hess = torch.diag(c.sum(1)) - c  # the negative Hessian, a graph Laplacian
        step = torch.linalg.lstsq(hess, grad[:, None], driver="gelsd").solution[:, 0]  # min-norm: no gauge drift
        step = step - step.mean()
        theta = theta + step
        if float(step.abs().max()) < tol:
            break
    return theta - theta.mean()


def elo(theta: torch.Tensor | float) -> Any:
    """Strength on the Elo scale: ``1000 + 400 / ln 10 * theta`` (a 400-point gap is 10:1 odds)."""
    return 1000.0 + ELO_SCALE * theta


def _wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (centre - half, centre + half)


def position_bias(verdicts: Sequence[Verdict]) -> dict[str, Any]:
    """First-position win rate (Wilson 95% interval, ``biased`` when it excludes 0.5) and the flip rate."""
    decisive = [v for v in verdicts if v.winner != "tie"]
    first = sum(v.winner == "a" for v in decisive)
    lo, hi = _wilson(first, len(decisive))
    # the two orders of one comparison: same key, same pair of models, shown the other way round
    by_order: dict[tuple[str, str, str], list[Verdict]] = {}
    for v in verdicts:
        if v.key is not None:
            by_order.setdefault((v.key, v.model_a, v.model_b), []).append(v)
    pairs = flips = 0
    for (key, a, b), shown in by_order.items():
        if a > b or (key, b, a) not in by_order:
            continue  # count each comparison once, from the order whose first model sorts first
        for v1, v2 in zip(shown, by_order[(key, b, a)]):
            winner1 = {"a": a, "b": b, "tie": None}[v1.winner]
            winner2 = {"a": b, "b": a, "tie": None}[v2.winner]
            pairs += 1
            flips += winner1 != winner2
    rate = first / len(decisive) if decisive else float("nan")
    return {"decisive_verdicts": len(decisive), "first_position_wins": first, "first_position_win_rate": rate,
            "first_position_win_rate_ci95": [lo, hi], "biased": bool(decisive) and not lo <= 0.5 <= hi,
            "pairs_judged_both_orders": pairs, "flips": flips,
            "flip_rate": flips / pairs if pairs else None}


@attrs.frozen
class JudgeRanking:
    """The ranking: one row per model, best first, and the position-bias check."""

    rows: list[dict[str, Any]]
    position_bias: dict[str, Any]
    verdicts: int
    bootstrap: int
    confidence: float
    prior: float

    def to_dict(self) -> dict[str, Any]:
        return {"ranking": self.rows, "position_bias": self.position_bias, "verdicts": self.verdicts,
                "bootstrap": self.bootstrap, "confidence": self.confidence, "prior": self.prior,
                "model": "bradley-terry (ties = half-wins), newton; percentile bootstrap over verdicts"}

    def table(self) -> str:
        """A plain-text table (rank, model, Elo with its interval, theta, record)."""
        pct = f"{int(round(self.confidence * 100))}%"
        head = ("rank", "model", "elo", f"{pct} interval", "theta", "w-l-t", "games")
        lines = [head]
        for r in self.rows:
            lines.append((str(r["rank"]), r["model"], f"{r['elo']:.1f}",
                          f"{r['elo_ci'][0]:.1f} .. {r['elo_ci'][1]:.1f}", f"{r['theta']:+.3f}",
                          f"{r['wins']}-{r['losses']}-{r['ties']}", str(r["games"])))
        widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
        text = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines]
        pb = self.position_bias
        text.append("")
        text.append(f"position bias: first-shown answer won {pb['first_position_wins']} of {pb['decisive_verdicts']} "
                    f"decisive verdicts ({pb['first_position_win_rate']:.3f}, 95% "
                    f"{pb['first_position_win_rate_ci95'][0]:.3f} .. {pb['first_position_win_rate_ci95'][1]:.3f})"
                    + ("  <- BIASED (interval excludes 0.5)" if pb["biased"] else ""))
        if pb["flip_rate"] is not None:
            text.append(f"flip rate: {pb['flips']} of {pb['pairs_judged_both_orders']} comparisons judged in both "
                        f"orders changed winner ({pb['flip_rate']:.3f})")
        else:
            text.append("flip rate: n/a (no comparison judged in both orders; give verdicts a question_id)")
        return "\n".join(text)


def rank_models(verdicts: Sequence[Verdict], *, bootstrap: int = 200, confidence: float = 0.95, prior: float = 0.1,
                seed: int = 0, models: Sequence[str] | None = None) -> JudgeRanking:
    """Bradley-Terry strengths with percentile-bootstrap intervals, ranked best first.

    Args:
        verdicts: from ``read_verdicts`` or ``collect_verdicts``.
        bootstrap: resamples of the verdicts (0: no intervals).
        confidence: the intervals' coverage.
        prior: pseudo-ties between every two models (see the module docstring).
        seed: the bootstrap's random seed.
        models: the models (default: every model named, sorted).
    """
    if not verdicts:
        raise DataError("no verdicts to rank; judge some pairs first")
    names = list(models) if models else sorted({v.model_a for v in verdicts} | {v.model_b for v in verdicts})
    index = {m: i for i, m in enumerate(names)}
    encoded = _encode(verdicts, index)
    W, N = _counts(encoded, len(names))
    theta = fit_bradley_terry(W, prior=prior)
    alpha = (1 - confidence) / 2
    if bootstrap > 0:
        g = torch.Generator().manual_seed(seed)
        n = len(verdicts)
        samples = []
        for _ in range(bootstrap):
            # a resample with replacement, as multiplicities: the counts are linear in them
            mult = torch.bincount(torch.randint(0, n, (n,), generator=g), minlength=n)
            samples.append(fit_bradley_terry(_counts(encoded, len(names), mult)[0], prior=prior))
        boot = torch.stack(samples)  # (bootstrap, M)
        lo, hi = torch.quantile(boot, alpha, dim=0), torch.quantile(boot, 1 - alpha, dim=0)
    else:
        lo = hi = torch.full_like(theta, float("nan"))
    wins = torch.zeros(len(names), dtype=torch.long)
    losses = torch.zeros_like(wins)
    ties = torch.zeros_like(wins)
    for v in verdicts:
        a, b = index[v.model_a], index[v.model_b]
        if v.winner == "tie":
            ties[a] += 1
            ties[b] += 1
        else:
            w, lose = (a, b) if v.winner == "a" else (b, a)
            wins[w] += 1
            losses[lose] += 1
    order = sorted(range(len(names)), key=lambda i: -float(theta[i]))
    rows = [{"rank": r + 1, "model": names[i], "theta": float(theta[i]), "theta_ci": [float(lo[i]), float(hi[i])],
             "elo": float(elo(theta[i])), "elo_ci": [float(elo(lo[i])), float(elo(hi[i]))],
             "wins": int(wins[i]), "losses": int(losses[i]), "ties": int(ties[i]), "games": int(N[i].sum())}
            for r, i in enumerate(order)]
    return JudgeRanking(rows, position_bias(verdicts), len(verdicts), bootstrap, confidence, prior)


# -- collecting verdicts from a served judge ---------------------------------------------------------------------
def collect_verdicts(answers: str | os.PathLike[str], out: str | os.PathLike[str], *, base_url: str,
                     judge_model: str, api_key: str = "EMPTY", max_tokens: int = 512, client: Any = None,
                     progress: bool = False) -> list[Verdict]:
    """Judge every pair of answers to every question, in both orders, with a model behind an OpenAI API.

    Args:
        answers: JSONL of ``{"question_id": ..., "question": ..., "answers": {"model": "answer", ...}}``.
        out: the verdicts JSONL written (atomically, when every judgement is in).
        base_url: the server, e.g. ``http://127.0.0.1:8000/v1`` (``plyx serve``).
        judge_model: the model name the server serves.
        api_key: the server's key (``plyx serve`` accepts any unless configured).
        max_tokens: the judge's reply budget.
        client: an ``openai.OpenAI`` client instead of one built from ``base_url``.
        progress: show a progress bar.

    Returns:
        The verdicts; replies without a ``[[A]]``/``[[B]]``/``[[C]]`` are written with ``"winner": null`` and
        ``"unparsed": true`` and left out of the returned list (they are counted in the summary line).
    """
    if client is None:
        try:
            from openai import OpenAI
        except ImportError as exc:  # an optional dependency: only this mode needs it
            raise ImportError("collecting verdicts needs the openai client: pip install 'plyx-rl[judge]'") from exc
        client = OpenAI(base_url=base_url, api_key=api_key)
    jobs = []
    for number, rec in read_jsonl(answers):
        where = f"{answers}:{number}"
        if not isinstance(rec.get("question"), str) or not isinstance(rec.get("answers"), dict):
            raise DataError(f"{where}: a record needs 'question' (a string) and 'answers' ({{model: answer}})")
        given = {k: v for k, v in rec["answers"].items() if isinstance(v, str)}
        if len(given) < 2:
            raise DataError(f"{where}: at least two models' answers are needed to compare")
        qid = rec.get("question_id", number)
        for a, b in itertools.combinations(sorted(given), 2):
            jobs += [(qid, rec["question"], a, b, given), (qid, rec["question"], b, a, given)]
    if not jobs:
        raise DataError(f"{answers}: no questions; write one JSONL record per question")
    records, verdicts = [], []
    bar_cm: Any = None
    if progress:
        from rich.progress import Progress

        bar_cm = Progress()
    with bar_cm if bar_cm is not None else _Null() as bar:
        task = bar.add_task("judging", total=len(jobs)) if bar is not None else None
        for qid, question, a, b, given in jobs:
            reply = client.chat.completions.create(
                model=judge_model, temperature=0, max_tokens=max_tokens,
                messages=[{"role": "system", "content": JUDGE_SYSTEM_PROMPT},
                          {"role": "user", "content": judge_prompt(question, given[a], given[b])}])
            text = reply.choices[0].message.content or ""
            winner = parse_verdict(text)
            rec = {"question_id": qid, "model_a": a, "model_b": b,
                   "winner": {"a": "model_a", "b": "model_b", "tie": "tie", None: None}[winner], "judge": judge_model}
            if winner is None:
                rec["unparsed"] = True
            else:
                verdicts.append(Verdict(a, b, winner, json.dumps(qid, sort_keys=True)))
            records.append(rec)
            if bar is not None:
                bar.update(task, advance=1)
    path = Path(out)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    os.replace(tmp, path)
    return verdicts


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _read_collected(path: Path, models: Sequence[str] | None) -> list[Verdict]:
    """Collected verdicts minus the unparsed replies (whose winner is null)."""
    kept = path.with_name(f".{path.name}.parsed-{os.getpid()}")
    try:
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines()
                 if ln.strip() and json.loads(ln).get("winner") is not None]
        kept.write_text("\n".join(lines) + ("\n" if lines else ""), encoding="utf-8")
        return read_verdicts(kept, models)
    finally:
        kept.unlink(missing_ok=True)


# -- the command ----------------------------------------------------------------------------------------------
def configure_judge(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``plyx rl judge``."""
    parser.add_argument("verdicts", help="verdicts JSONL (read; with --collect: written first)")
    parser.add_argument("--models", help="comma-separated models to rank (default: every model named)")
    parser.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples (0: no intervals)")
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--prior", type=float, default=0.1, help="pseudo-ties between every two models")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_out", help="also write the ranking as JSON here")
    parser.add_argument("--collect", metavar="ANSWERS", help="judge ANSWERS.jsonl with a served judge model first")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="(--collect) the OpenAI API base URL")
    parser.add_argument("--judge-model", help="(--collect) the judge model's name on the server")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    parser.add_argument("--no-progress", action="store_true")


def run_judge(args: argparse.Namespace, print_fn: Callable[[str], None] = print) -> int:
    models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    try:
        if not 0 < args.confidence < 1:
            raise DataError(f"--confidence must be in (0, 1) (got {args.confidence}); e.g. 0.95")
        if args.bootstrap < 0 or args.prior < 0:
            raise DataError("--bootstrap and --prior must be >= 0")
        if args.collect:
            if not args.judge_model:
                raise DataError("--collect needs --judge-model (the served judge's model name)")
            got = collect_verdicts(args.collect, args.verdicts, base_url=args.base_url, judge_model=args.judge_model,
                                   api_key=args.api_key, progress=not args.no_progress)
            print_fn(f"collected {len(got)} parsed verdicts -> {args.verdicts}")
            verdicts = _read_collected(Path(args.verdicts), models)
        else:
            verdicts = read_verdicts(args.verdicts, models)
        ranking = rank_models(verdicts, bootstrap=args.bootstrap, confidence=args.confidence, prior=args.prior,
                              seed=args.seed, models=models)
    except (DataError, FileNotFoundError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_fn(ranking.table())
    if args.json_out:
        path = Path(args.json_out)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(ranking.to_dict(), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        print_fn(f"ranking: {path}")
    return 0
