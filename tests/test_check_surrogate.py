"""scripts/check_surrogate.py: the soft surrogate's score gradient, judged by the hard loss."""

import torch

from conftest import load_script


def _planted(seed: int, H=2, T=40, D=16, NP=4, n=96):
    """Values all equal except NP planted positions with large random values; the scores rank
    the planted positions just below the top-t threshold (t = 10 at rho 0.25), so the best
    anchor set needs them and the soft surrogate's candidates (top 2t) contain them."""
    g = torch.Generator().manual_seed(seed)
    K = 0.8 * torch.randn(H, T, D, generator=g)
    V = 0.3 * torch.randn(H, 1, D, generator=g).expand(H, T, D).clone()
    Q_fit, Q_hold = 2.0 * torch.randn(H, n, D, generator=g), 2.0 * torch.randn(H, n, D, generator=g)
    s = torch.empty(H, T)
    for h in range(H):
        perm = torch.randperm(T, generator=g)
        V[h, perm[10:10 + NP]] += 3.0 * torch.randn(NP, D, generator=g)  # ranks 11..14: just out
        s[h, perm] = torch.linspace(1.0, 0.0, T)
    return s, Q_fit, Q_hold, K, V, D ** -0.5


def test_gradient_step_moves_planted_anchors_in_and_lowers_the_hard_loss():
    mod = load_script("check_surrogate")
    gen = torch.Generator().manual_seed(0)
    wins = 0
    for seed in range(4):
        s, Qf, Qh, K, V, scaling = _planted(seed)
        base, ch = mod.surrogate_steps(s, Qf, Qh, K, V, scaling, 0.25, 0.3, 0.1, gen)
        assert base > 0 and set(ch) == {"-g", "+g", "random"}
        wins += ch["-g"] < 0 and ch["-g"] < ch["+g"] and ch["-g"] < ch["random"]
    assert wins == 4


def test_steps_too_small_to_change_the_top_t_leave_the_hard_loss_unchanged():
    mod = load_script("check_surrogate")
    s, Qf, Qh, K, V, scaling = _planted(7)
    _, ch = mod.surrogate_steps(s, Qf, Qh, K, V, scaling, 0.25, 0.3, 1e-6, torch.Generator().manual_seed(0))
    assert ch == {"-g": 0.0, "+g": 0.0, "random": 0.0}
