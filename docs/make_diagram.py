"""Draw docs/dataflow.svg: multi-head attention's forward and backward data flow, with shapes.

    python3 docs/make_diagram.py

The forward runs down the left column, each array in a box with its shape and each step on
the arrow with its formula and the function that computes it; the backward runs up the right
column, one row per forward step, in reverse. A dashed arrow carries what a backward step
reads from the forward (the cache). Written as plain SVG text (no dependency), the same
bytes on every run; tests/test_tutorial.py checks that the stored file is this script's.
"""
import pathlib
import sys
from xml.sax.saxutils import escape

OUT = pathlib.Path(__file__).resolve().parent / "dataflow.svg"
ROW, TOP, BOX_H = 92, 70, 44              # a row's height, the first row's top, a box's height
FORWARD_X, BACKWARD_X, BOX_W = 300, 760, 250

# (array, shape) per row, top to bottom: the forward's arrays, and the backward's gradients of them
FORWARD = [("query, key, value", "[B, N, D]"), ("Q, K, V", "[B, N, D]"), ("Qh, Kh, Vh", "[B, H, N, d_k]"),
           ("S", "[B, H, N_q, N_k]"), ("P", "[B, H, N_q, N_k]"), ("heads", "[B, H, N_q, d_k]"),
           ("concat", "[B, N_q, D]"), ("out", "[B, N_q, D]")]
BACKWARD = [("dquery, dkey, dvalue", "[B, N, D];  dW, db"), ("dQ, dK, dV", "[B, N, D]"),
            ("dQh, dKh, dVh", "[B, H, N, d_k]"), ("dS", "[B, H, N_q, N_k]"), ("dP", "[B, H, N_q, N_k]"),
            ("dheads", "[B, H, N_q, d_k]"), ("dconcat", "[B, N_q, D];  dW_o, db_o"), ("dout", "[B, N_q, D]")]
# the step from row i to row i + 1: (formula, function) forward; backward from row i + 1 to row i
FORWARD_STEPS = [("Q = query W_q + b_q  (K, V alike)", "linear.py: linear_forward"),
                 ("cut D into H heads of d_k", "heads.py: split_heads"),
                 ("S = Qh Kh^T / sqrt(d_k)", "scores.py: attention_scores"),
                 ("P = softmax(S), row by row", "softmax.py: softmax_forward"),
                 ("heads = P Vh", "textbook.py: textbook_forward"),
                 ("join the H heads into D", "heads.py: merge_heads"),
                 ("out = concat W_o + b_o", "linear.py: linear_forward")]
BACKWARD_STEPS = [("dquery = dQ W_q^T, dW_q = query^T dQ, db_q = sum dQ", "linear.py: linear_backward"),
                  ("dQ = merge_heads(dQh)  (split's backward)", "heads.py: merge_heads"),
                  ("dQh = dS Kh / sqrt(d_k), dKh = dS^T Qh / sqrt(d_k)", "textbook.py: textbook_backward"),
                  ("dS = P * (dP - rowsum(P * dP))", "softmax.py: softmax_backward"),
                  ("dP = dheads Vh^T,  dVh = P^T dheads", "textbook.py: textbook_backward"),
                  ("dheads = split_heads(dconcat)  (merge's backward)", "heads.py: split_heads"),
                  ("dconcat = dout W_o^T, dW_o = concat^T dout", "linear.py: linear_backward")]
# what each backward row's step reads from the forward: (forward row, backward row, label)
CACHE = [(0, 0, "query, key, value"), (2, 2, "Qh, Kh"), (4, 4, "P, Vh"), (6, 6, "concat")]


def _text(x, y, words, size=13, anchor="middle", weight="normal", color="#222"):
    return (f'<text x="{x}" y="{y}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}" '
            f'fill="{color}">{escape(words)}</text>')


def _box(x, y, name, shape, fill):
    return [f'<rect x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="6" fill="{fill}" stroke="#555"/>',
            _text(x + BOX_W // 2, y + 19, name, 14, weight="bold"), _text(x + BOX_W // 2, y + 36, shape, 12)]


def _arrow(x1, y1, x2, y2, dashed=False, color="#333"):
    dash = ' stroke-dasharray="6,4"' if dashed else ""
    return (f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{color}" stroke-width="1.6"{dash} '
            f'marker-end="url(#head)"/>')


def _step(x, y, formula, function, anchor):
    return [_text(x, y - 4, formula, 12, anchor), _text(x, y + 12, function, 11, anchor, color="#2a6099")]


def svg():
    """The diagram as SVG text."""
    rows = len(FORWARD)
    top = lambda i: TOP + i * ROW
    width, height = BACKWARD_X + BOX_W + 410, top(rows - 1) + BOX_H + 20
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Arial, sans-serif">',
             '<defs><marker id="head" markerWidth="10" markerHeight="8" refX="9" refY="4" orient="auto">'
             '<path d="M0,0 L10,4 L0,8 z" fill="#333"/></marker></defs>',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             _text(FORWARD_X + BOX_W // 2, 30, "forward (down)", 16, weight="bold"),
             _text(BACKWARD_X + BOX_W // 2, 30, "backward (up): d = dL/d", 16, weight="bold"),
             _text(width // 2, 52, "B batch, N_q / N_k lengths, D = d_model, H heads, d_k = D / H", 12,
                   color="#555")]
    for i, ((name, shape), (dname, dshape)) in enumerate(zip(FORWARD, BACKWARD)):
        parts += _box(FORWARD_X, top(i), name, shape, "#e8f1fa")
        parts += _box(BACKWARD_X, top(i), dname, dshape, "#fbeee4")
    middle = lambda i: top(i) + BOX_H + (ROW - BOX_H) // 2          # between row i and row i + 1
    for i, (formula, function) in enumerate(FORWARD_STEPS):
        parts.append(_arrow(FORWARD_X + BOX_W // 2, top(i) + BOX_H, FORWARD_X + BOX_W // 2, top(i + 1) - 2))
        parts += _step(FORWARD_X - 12, middle(i), formula, function, "end")
    for i, (formula, function) in enumerate(BACKWARD_STEPS):
        parts.append(_arrow(BACKWARD_X + BOX_W // 2, top(i + 1), BACKWARD_X + BOX_W // 2, top(i) + BOX_H + 2))
        parts += _step(BACKWARD_X + BOX_W + 12, middle(i), formula, function, "start")
    for forward_row, backward_row, label in CACHE:
        y = top(forward_row) + BOX_H // 2
        parts.append(_arrow(FORWARD_X + BOX_W, y, BACKWARD_X - 2, top(backward_row) + BOX_H // 2,
                            dashed=True, color="#888"))
        parts.append(_text((FORWARD_X + BOX_W + BACKWARD_X) // 2, y - 6, f"cache: {label}", 11, color="#666"))
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main():
    OUT.write_text(svg())
    print(f"wrote {OUT.relative_to(OUT.parents[1])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
