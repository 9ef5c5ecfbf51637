# %% [markdown]
# # Attention backprop by the numbers
#
# The blog post ("从点积到信息检索：深度揭秘 Transformer 注意力机制的数学本质", *From dot products
# to information retrieval*) explains the forward pass of multi-head attention. This notebook
# runs it on numbers small enough to check by hand, then goes **backward** through every
# line, and checks each gradient against a number computed without any derivative: the
# complex step. Then it looks inside the softmax's Jacobian, draws how heads are split and
# merged, measures why attention divides by $\sqrt{d_k}$, and ends with exercises: write
# each backward yourself, and `exercises.check` tells you which line is wrong.
#
# **Notation.** The blog calls the softmax's *output* $S$ (section 3.4: $\text{Output} = SV$).
# Here, as in FlashAttention and PyTorch, $S$ is the softmax's *input*, the scores, and $P$ is
# its output, the attention weights:
#
# $$S = \frac{QK^\top}{\sqrt{d_k}}, \qquad P = \mathrm{softmax}(S), \qquad \text{out} = PV.$$
#
# A gradient is written `d` + the name: `dP` is $\partial L / \partial P$ for the loss $L$.
#
# The source of this notebook is `docs/tutorial.py` (run it as a script, or rebuild the
# notebook with `python3 docs/make_tutorial.py`); the code it explains is
# `numpy_attention/textbook.py`, `softmax.py`, `heads.py`, `linear.py` and `multihead.py`.

# %%
import numpy as np
import matplotlib.pyplot as plt

import numpy_attention as na
from numpy_attention import exercises

np.set_printoptions(precision=4, suppress=True, floatmode="fixed")

# %% [markdown]
# ## 1. The forward pass on 3 tokens
#
# Three tokens, $d_{model} = 4$, two heads of $d_k = 2$. Small integers, so that the first
# products can be checked by hand.
#
# **Section 2 of the blog:** $Q = XW^Q,\ K = XW^K,\ V = XW^V$ (self-attention: the same $X$
# three times). `linear.py: linear_forward` computes $Y = XW + b$; the weights here are in
# the math layout $[d_{in}, d_{out}]$ (PyTorch's `nn.Linear` stores $W^\top$).

# %%
X = np.array([[1., 0., 2., -1.],          # [N, d_model]: token 0
              [0., 1., -1., 1.],          #               token 1
              [2., -1., 0., 1.]])         #               token 2
rng = np.random.default_rng(0)
W = {name: rng.integers(-2, 3, (4, 4)) / 2 for name in ("q", "k", "v", "o")}   # [d_in, d_out]
H, d_k = 2, 2

Q, K, V = (na.linear_forward(X, W[n])[0] for n in "qkv")   # [N, d_model] each
print("W_q =\n", W["q"])
print("Q = X W_q =\n", Q)

# %% [markdown]
# **Section 5:** the 4 columns of $Q$ are cut into 2 heads of 2 columns each:
# `heads.py: split_heads` turns $[N, d_{model}]$ into $[H, N, d_k]$. Each head then runs
# attention on its own slice.

# %%
Qh, Kh, Vh = (na.split_heads(x, H) for x in (Q, K, V))      # [H, N, d_k]
print("head 0 of Q (columns 0-1):\n", Qh[0])
print("head 1 of Q (columns 2-3):\n", Qh[1])

# %% [markdown]
# **Sections 3.1 and 3.2:** the scores. Row $i$, column $j$ of $S$ is how well query $i$
# matches key $j$, divided by $\sqrt{d_k}$ (section 4 of this notebook measures why).

# %%
S = Qh @ Kh.swapaxes(-1, -2) / np.sqrt(d_k)                 # [H, N_q, N_k]
print("S, head 0:\n", S[0])

# %% [markdown]
# **Section 3.3:** each row of $S$ becomes a probability distribution,
# $P_{ij} = e^{S_{ij}} / \sum_k e^{S_{ik}}$ (`softmax.py: softmax_forward`).

# %%
P, softmax_cache = na.softmax_forward(S)                    # [H, N_q, N_k]
print("P, head 0:\n", P[0])
print("each row sums to 1:", P.sum(axis=-1))

# %% [markdown]
# **Section 3.4:** each token's output is a weighted average of the value rows. Then the
# heads are merged back to $[N, d_{model}]$ (`heads.py: merge_heads`) and projected by
# $W^O$ (section 5): $\text{MultiHead} = \text{Concat}(\text{head}_1, \text{head}_2)\,W^O$.

# %%
heads = P @ Vh                                              # [H, N_q, d_k]
concat = na.merge_heads(heads)                              # [N, d_model]
out = concat @ W["o"]                                       # [N, d_model]
print("out =\n", out)

# %% [markdown]
# The same numbers from the package's own module (`multihead.py: multihead_forward`, the
# five steps above; `textbook.py: textbook_forward` inside):

# %%
params = {f"W_{n}.weight": W[n].T for n in "qkvo"}          # torch's layout [d_out, d_in]
params.update({f"W_{n}.bias": np.zeros(4) for n in "qkvo"})
out_na, weights_na, _ = na.multihead_forward(X[None], X[None], X[None], params, H)
print("the same out:", np.allclose(out_na[0], out, rtol=1e-14, atol=1e-14),
      "  the same P:", np.allclose(weights_na[0], P, rtol=1e-14, atol=1e-14))

# %% [markdown]
# ## 2. The backward pass, line by line
#
# Training needs the gradient of a loss $L$ with respect to every weight. Take
# $L = \langle G, \text{out} \rangle = \sum G \odot \text{out}$ for a **random** upstream
# gradient $G$: then $\partial L / \partial\,\text{out} = G$, and each backward line below
# turns the gradient of a step's output into the gradient of its input. (Why random and
# not $L = \sum \text{out}$: section 3 shows that the gradient of a sum hides every softmax
# bug.)
#
# Each gradient is printed next to its **complex-step** value. For a function $f$ that is
# analytic, $f(x + ih) = f(x) + ih f'(x) + O(h^2)$, so
# $f'(x) = \mathrm{Im}\, f(x + ih) / h$ with no subtraction: $h = 10^{-20}$ gives the
# derivative to about 16 digits. `numerical_gradient` perturbs one entry at a time, with
# the package's own `na.directional_derivative`.

# %%
G = np.round(rng.standard_normal(out.shape), 1)             # the upstream gradient dL/d out


def numerical_gradient(loss_of, x):
    """dL/dx entry by entry: Im L(x + i h e_j) / h, the complex step, h = 1e-20."""
    grad = np.zeros(x.shape)
    for j in np.ndindex(x.shape):
        unit = np.zeros(x.shape)
        unit[j] = 1.0
        grad[j] = na.directional_derivative(loss_of, x, unit, "complex", 1e-20)
    return grad


def loss_from_heads(heads):                                 # the forward from each step on
    return np.sum(G * (na.merge_heads(heads) @ W["o"]))


def loss_from_P(P):
    return loss_from_heads(P @ Vh)


def loss_from_S(S):
    return loss_from_P(na.softmax_forward(S)[0])


def show(name, hand, step):
    print(f"{name} by hand:\n{hand}\n{name} by complex step:\n{step}")
    print(f"agree to 1e-13: {np.allclose(hand, step, rtol=0, atol=1e-13 * np.abs(step).max())}\n")


# %% [markdown]
# **Output projection**, $\text{out} = \text{concat}\, W^O$: $\;dW^O = \text{concat}^\top G$,
# $\;d\,\text{concat} = G\,{W^O}^\top$ (`linear.py: linear_backward`). Merging heads moved
# entries around without changing them, so its backward moves them back: `split_heads`.

# %%
dW_o = concat.T @ G                                         # [d_model, d_model]
dheads = na.split_heads(G @ W["o"].T, H)                    # [H, N, d_k]
show("dW_o", dW_o, numerical_gradient(lambda w: np.sum(G * (concat @ w)), W["o"]))
show("dheads, head 0", dheads[0], numerical_gradient(loss_from_heads, heads)[0])

# %% [markdown]
# **Weighted sum**, $\text{heads} = PV$: $\;dV = P^\top d\text{heads}$ (every query row
# that read value $j$ sends it gradient, weighted by how much it read), and
# $\;dP = d\text{heads}\,V^\top$.

# %%
dVh = P.swapaxes(-1, -2) @ dheads                           # [H, N_k, d_k]
dP = dheads @ Vh.swapaxes(-1, -2)                           # [H, N_q, N_k]
show("dV, head 0", dVh[0], numerical_gradient(lambda v: loss_from_heads(P @ v), Vh)[0])
show("dP, head 0", dP[0], numerical_gradient(loss_from_P, P)[0])

# %% [markdown]
# **Softmax**, $P = \mathrm{softmax}(S)$: $\;dS = P \odot (dP - \mathrm{rowsum}(P \odot dP))$
# (`softmax.py: softmax_backward`; section 3 takes this line apart).

# %%
dS = P * (dP - np.sum(P * dP, axis=-1, keepdims=True))      # [H, N_q, N_k]
show("dS, head 0", dS[0], numerical_gradient(loss_from_S, S)[0])

# %% [markdown]
# **Scores**, $S = QK^\top/\sqrt{d_k}$: $\;dQ = dS\,K/\sqrt{d_k}$ and
# $\;dK = dS^\top Q/\sqrt{d_k}$. The $1/\sqrt{d_k}$ of the forward multiplies both.

# %%
dQh = dS @ Kh / np.sqrt(d_k)                                # [H, N_q, d_k]
dKh = dS.swapaxes(-1, -2) @ Qh / np.sqrt(d_k)               # [H, N_k, d_k]
scores_of = lambda q, k: q @ k.swapaxes(-1, -2) / np.sqrt(d_k)
show("dQ, head 0", dQh[0], numerical_gradient(lambda q: loss_from_S(scores_of(q, Kh)), Qh)[0])
show("dK, head 0", dKh[0], numerical_gradient(lambda k: loss_from_S(scores_of(Qh, k)), Kh)[0])

# %% [markdown]
# **Projections**, $Q = XW^Q$ and likewise: merge the heads' gradients back to
# $[N, d_{model}]$ (`merge_heads` undoes `split_heads`), then $dW^Q = X^\top dQ$, and likewise
# for $W^K$ and $W^V$. Their complex-step values run the whole forward, from the weights to
# $L$: the chain, checked end to end.

# %%
dW_q, dW_k, dW_v = (X.T @ na.merge_heads(d) for d in (dQh, dKh, dVh))   # [d_model, d_model]


def loss_from_weights(w_q, w_k, w_v):                       # the whole forward, from the weights
    Qw, Kw, Vw = (na.split_heads(X @ w, H) for w in (w_q, w_k, w_v))
    return loss_from_heads(na.softmax_forward(scores_of(Qw, Kw))[0] @ Vw)


show("dW_q", dW_q, numerical_gradient(lambda w: loss_from_weights(w, W["k"], W["v"]), W["q"]))
show("dW_k", dW_k, numerical_gradient(lambda w: loss_from_weights(W["q"], w, W["v"]), W["k"]))
show("dW_v", dW_v, numerical_gradient(lambda w: loss_from_weights(W["q"], W["k"], w), W["v"]))

# %% [markdown]
# The package's backward (`na.multihead_backward`: the five steps in reverse, one line each)
# gives the same numbers; its weights' gradients come in torch's layout, transposed:

# %%
_, _, cache = na.multihead_forward(X[None], X[None], X[None], params, H)
grads = na.multihead_backward(G[None], cache)
for name, hand in (("W_q", dW_q), ("W_k", dW_k), ("W_v", dW_v), ("W_o", dW_o)):
    print(f"the same d{name}:", np.allclose(grads[f"{name}.weight"].T, hand, rtol=1e-13, atol=1e-13))

# %% [markdown]
# ## 3. Inside the softmax: the Jacobian and the rowsum
#
# One row $p$ of $P$ depends on every entry of its row of $S$. Its Jacobian is
# $J_{ij} = \partial p_i / \partial s_j = p_i([i = j] - p_j)$, that is
# $J = \mathrm{diag}(p) - pp^\top$ (`softmax.py: softmax_jacobian`).

# %%
p, dp = P[0, 0], dP[0, 0]                                   # head 0, query row 0
J = na.softmax_jacobian(p)                                  # [N_k, N_k]
print("p =", p)
print("J = diag(p) - p p^T =\n", J)
print("J is symmetric:", np.allclose(J, J.T), "  each row of J sums to 0:", np.abs(J.sum(axis=1)).max() < 1e-15)

# %%
fig, ax = plt.subplots(figsize=(4.2, 3.4))
image = ax.imshow(J, cmap="RdBu_r", vmin=-0.3, vmax=0.3)
for (i, j), value in np.ndenumerate(J):
    ax.text(j, i, f"{value:.3f}", ha="center", va="center", fontsize=9)
ax.set(xlabel="j (score s_j)", ylabel="i (weight p_i)", xticks=range(3), yticks=range(3),
       title="J = diag(p) - p p^T, head 0, row 0")
fig.colorbar(image, ax=ax, label="dp_i / ds_j")
fig.tight_layout()
plt.show()

# %% [markdown]
# The diagonal is positive (raising $s_i$ raises $p_i$), everything else negative (it takes
# weight from the others). The backward multiplies $dp$ by $J$ (symmetric, so $J^\top = J$):
#
# $$ds_i = \sum_j J_{ij}\, dp_j = p_i\, dp_i - p_i \sum_j p_j\, dp_j = p_i\big(dp_i - \textstyle\sum_j p_j\, dp_j\big).$$
#
# The second term is where $\mathrm{rowsum}(P \odot dP)$ comes from: $\sum_j p_j\, dp_j$, one
# number per row, the weighted average of $dp$. Forgetting it leaves $p_i\, dp_i$, only the
# $\mathrm{diag}(p)$ part of $J$. On this row:

# %%
rowsum = np.sum(p * dp)
print("dp                =", dp)
print("rowsum(p * dp)    =", np.round(rowsum, 4))
print("J @ dp            =", J @ dp)
print("p * (dp - rowsum) =", p * (dp - rowsum))
print("p * dp (wrong)    =", p * dp)

# %% [markdown]
# And why a gradient check must not use $L = \sum P$: its upstream gradient is $dp = 1$, and
# $J\,\mathbf{1} = 0$, because each row of $J$ sums to 0 (the weights sum to 1 whatever $s$
# is, so no change of $s$ changes their sum). Checked that way, the right backward's answer is
# 0, and so is any backward that returns 0 for every input, or any that is wrong only in
# how it uses $dp$. A random $dp$ tells them all apart.

# %%
ones = np.ones(3)
print("J @ 1 =", np.round(J @ ones, 4) + 0.0)                  # (+ 0.0: -0.0000 prints as 0.0000)
print("right backward with dp = 1:", np.round(p * (ones - np.sum(p * ones)), 4) + 0.0)
print("without the rowsum term:   ", p * ones)

# %% [markdown]
# ## 4. Splitting and merging heads, drawn
#
# `split_heads` reshapes $[N, d_{model}]$ to $[N, H, d_k]$ (each token's row cut into $H$
# pieces), then swaps the axes to $[H, N, d_k]$, so that each head holds every token's
# piece. `merge_heads` swaps back and reshapes. A plain reshape to $[H, N, d_k]$ without
# the swap would give head 0 the first rows of the *flattened* array: pieces of different
# tokens, mixed. Below, the entries are numbered $10 \cdot \text{token} + \text{column}$.

# %%
N, D = 3, 4
numbered = 10 * np.arange(N)[:, None] + np.arange(D)[None, :]    # [N, D]: 10 * token + column
panels = [("X [N, D]", numbered, np.arange(D)[None, :].repeat(N, 0) // d_k)]
split = na.split_heads(numbered.astype(float), H)                # [H, N, d_k]
wrong = numbered.reshape(H, N, d_k)                             # the reshape without the swap
for h in range(H):
    panels.append((f"split_heads: head {h} [N, d_k]", split[h], np.full((N, d_k), h)))
panels.append(("reshape without the swap:\n'head 0' [N, d_k]", wrong[0], (wrong[0] % 10) // d_k))

colors = np.array([[0.62, 0.79, 0.88], [0.99, 0.73, 0.55]])      # head 0, head 1
fig, axes = plt.subplots(1, len(panels), figsize=(12, 3.2),
                         gridspec_kw={"width_ratios": [D, d_k, d_k, d_k]})
for ax, (title, values, head_of) in zip(axes, panels):
    ax.imshow(colors[head_of])
    for (i, j), value in np.ndenumerate(values):
        ax.text(j, i, f"{int(value):02d}", ha="center", va="center", fontsize=11)
    ax.set(title=title, xlabel="column (model width)", ylabel="token", xticks=range(values.shape[1]),
           yticks=range(N))
    ax.title.set_fontsize(9)
fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colors[h], label=f"columns of head {h}") for h in range(H)],
           loc="lower center", ncol=H, fontsize=9)
fig.tight_layout(rect=(0, 0.1, 1, 1))
plt.show()
print("merge_heads undoes split_heads:", np.array_equal(na.merge_heads(split), numbered))

# %% [markdown]
# In the last panel the reshape fills "head 0" with the first six entries of the flattened
# array: its row 1 is token 0's *head-1* columns (`02 03`) and its row 2 is token 1's
# (`10 11`). Its rows no longer belong to one token each, and attention would compare pieces
# of different tokens. The exercise `merge_heads` below catches exactly this mistake.

# %% [markdown]
# ## 5. Why divide by $\sqrt{d_k}$: the gradient, measured
#
# Section 3.2 of the blog: with $q, k$ entries of variance 1, $\mathrm{Var}(q \cdot k) = d_k$.
# Without the scale, large $d_k$ gives scores of spread $\sqrt{d_k}$; the softmax saturates
# (one weight near 1), $J = \mathrm{diag}(p) - pp^\top$ nearly vanishes, and so does the
# gradient. `numpy_attention.experiments.sweep` measures it: one query against $N_k$ keys,
# 100 random trials per cell, the median of $\|J\|_F$ and of $\|\partial L/\partial q\|$
# (each gradient verified by complex step inside the sweep).

# %%
from numpy_attention.experiments import sweep

records = sweep(d_ks=(1, 4, 16, 64, 256, 1024, 4096), n_keys=(8, 128), trials=100)
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
for ax, key, label in zip(axes, ("jacobian_norm", "grad_norm"), ("median ||J||_F", "median ||dL/dq||")):
    for n, color in zip((8, 128), ("tab:blue", "tab:red")):
        for scaled, style in ((True, "-o"), (False, "--s")):
            rows = [r for r in records if r["n_keys"] == n and r["scaled"] is scaled]
            ax.plot([r["d_k"] for r in rows], [r[key] for r in rows], style, color=color,
                    label=f"N_k = {n}, {'S = q k^T / sqrt(d_k)' if scaled else 'S = q k^T (unscaled)'}")
    ax.set(xscale="log", yscale="log", xlabel="d_k", ylabel=label, title=f"{label} against d_k")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
fig.tight_layout()
plt.show()
for r in records:
    if r["d_k"] in (16, 256, 4096):
        print(f"N_k = {r['n_keys']:3d}, d_k = {r['d_k']:4d}, {'scaled  ' if r['scaled'] else 'unscaled'}: "
              f"max p {r['max_weight']:.3g}, ||J|| {r['jacobian_norm']:.3g}, ||dq|| {r['grad_norm']:.3g}")

# %% [markdown]
# Scaled (solid lines), both norms stay flat at every $d_k$. Unscaled (dashed), they fall by
# orders of magnitude once $d_k$ is large: at $d_k = 4096$ with 8 keys the median gradient is
# about $10^{-10}$ of the scaled one, and learning stops.
#
# **The curves are not monotone**, which the blog does not say. A near-uniform softmax has
# $\|J\|_F \approx 1/\sqrt{N_k}$ (small for 128 keys); a *little* saturation concentrates the
# weights on a few keys and first **raises** $\|J\|_F$ (the dashed red curve climbs up to
# $d_k = 16$-$64$), and the unscaled gradient also carries a factor $\|k\| \approx \sqrt{d_k}$,
# so it is *larger* than the scaled one up to $d_k = 256$ with 128 keys. Vanishing sets in only
# once the spread of the scores ($\sqrt{d_k}$) beats the gap between the largest two of
# $N_k$ scores; with more keys the top two are closer together, so 128 keys vanish later and
# less than 8. The full table and the tails are in `docs/vanishing.md`.

# %% [markdown]
# ## 6. Exercises: write the backward yourself
#
# Fill in each function, then run its cell. `exercises.check(name, function)` runs your
# function on two small cases (one square, where a transposed product still has the right
# shape, and one not), compares it with the gradient by complex step under a random
# upstream gradient, and says in words what is wrong: which output, what the error looks
# like (a factor, a shape, a missing term), and for the known mistakes, which line and why.
# Until you write a body, each says "not written yet". The reference solutions are in
# `numpy_attention/exercises/solutions.py`: look after trying.
#
# Here is what a wrong answer looks like: a softmax backward without the rowsum term.

# %%
def softmax_backward_wrong(dp, p):
    return p * dp


print(exercises.check("softmax_backward", softmax_backward_wrong))

# %% [markdown]
# **Exercise 1.** $y = xW + b$ with $x\ [\dots, d_{in}]$, $W\ [d_{in}, d_{out}]$: return
# $(dx, dW, db)$.

# %%
def linear_backward(dy, x, W):
    # dx = ..., dW = ..., db = ...   (dW and db sum over every leading axis of x and dy)
    raise NotImplementedError


print(exercises.check("linear_backward", linear_backward))

# %% [markdown]
# **Exercise 2.** $p = \mathrm{softmax}(z)$ over the last axis: return $dz$ from $dp$ and $p$.

# %%
def softmax_backward(dp, p):
    raise NotImplementedError


print(exercises.check("softmax_backward", softmax_backward))

# %% [markdown]
# **Exercise 3.** $\text{out} = PV$, $P = \mathrm{softmax}(QK^\top/\sqrt{d_k})$, with $P$ given:
# return $(dq, dk, dv)$. Shapes: q $[\dots, N_q, d_k]$, k $[\dots, N_k, d_k]$, v
# $[\dots, N_k, d_v]$, p $[\dots, N_q, N_k]$.

# %%
def attention_backward(dout, q, k, v, p):
    raise NotImplementedError


print(exercises.check("attention_backward", attention_backward))

# %% [markdown]
# **Exercise 4.** `split_heads`: $[B, N, D] \to [B, H, N, D/H]$, and `merge_heads`, its inverse
# (and its backward).

# %%
def split_heads(x, num_heads):
    raise NotImplementedError


def merge_heads(xh):
    raise NotImplementedError


print(exercises.check("split_heads", split_heads))
print(exercises.check("merge_heads", merge_heads))

# %% [markdown]
# **Exercise 5.** The module's backward: `exercises.multihead_forward(query, key, value,
# params, num_heads)` runs the five steps and returns `(out, cache)`, a dict of what each
# step made (`query`, `key`, `value`, `params`, `num_heads`, `Qh`, `Kh`, `Vh`, `P`, `heads`,
# `concat`). Return the gradients of every input and parameter, `{"query", "key", "value",
# "W_q", "b_q", ..., "W_o", "b_o"}`, in the math layout: the five steps in reverse, one
# line each, with your functions from exercises 1-4.

# %%
def multihead_backward(dout, cache):
    raise NotImplementedError


print(exercises.check("multihead_backward", multihead_backward))
