#!/usr/bin/python3
"""PyTorch side of test_train_torch: trains the model described by DIR/config.json from the
initial flat parameters DIR/params0.f32 (locus layout == state_dict order) on the batches in
DIR/x.f32 (+ labels.i32 or targets.f32) and writes DIR/params_final.f32 and DIR/losses.f64.

The learning rate of each step is computed here from the schedule formula documented in
lib/train/include/locus/train/optim/schedule.hpp, independently of the C++ implementation.
"""
import json
import math
import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np  # noqa: E402
import torch  # noqa: E402


class Mlp(torch.nn.Module):
    def __init__(self, widths, activation):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(widths[i], widths[i + 1]) for i in range(len(widths) - 1))
        self.act = {"relu": torch.nn.ReLU(), "gelu": torch.nn.GELU(approximate="tanh"),
                    "tanh": torch.nn.Tanh()}[activation]

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = self.act(x)
        return x


def learning_rate(s, c):
    base, warm = c["base_lr"], c["warmup_steps"]
    if s < warm:
        return base * (s + 1) / warm
    t = s - warm
    if c["schedule"] == "constant":
        return base
    if c["schedule"] == "step":
        return base * c["gamma"] ** (t // c["step_size"])
    span = c["total_steps"] - warm
    return c["min_lr"] + (base - c["min_lr"]) * (1 + math.cos(math.pi * min(t, span) / span)) / 2


def make_optimizer(params, c):
    kind, wd = c["optimizer"], c["weight_decay"]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=c["base_lr"], momentum=c["momentum"],
                               dampening=c["dampening"], nesterov=c["nesterov"],
                               weight_decay=wd)
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    return cls(params, lr=c["base_lr"], betas=(c["beta1"], c["beta2"]), eps=c["eps"],
               weight_decay=wd)


def main(d):
    torch.set_num_threads(1)
    c = json.load(open(os.path.join(d, "config.json")))
    widths, batch, steps = c["widths"], c["batch"], c["steps"]
    model = Mlp(widths, c["activation"])
    flat = np.fromfile(os.path.join(d, "params0.f32"), dtype="<f4")
    state, offset = {}, 0
    for name, tensor in model.state_dict().items():  # state_dict order == locus layout
        n = tensor.numel()
        state[name] = torch.from_numpy(flat[offset:offset + n].copy()).view(tensor.shape)
        offset += n
    assert offset == flat.size, f"layout size {flat.size} != state_dict size {offset}"
    model.load_state_dict(state)

    x = torch.from_numpy(np.fromfile(os.path.join(d, "x.f32"), dtype="<f4"))
    x = x.view(steps, batch, widths[0])
    if c["loss"] == "cross_entropy":
        y = torch.from_numpy(np.fromfile(os.path.join(d, "labels.i32"), dtype="<i4"))
        y = y.long().view(steps, batch)
        loss_fn = torch.nn.CrossEntropyLoss()
    else:
        y = torch.from_numpy(np.fromfile(os.path.join(d, "targets.f32"), dtype="<f4"))
        y = y.view(steps, batch, widths[-1])
        loss_fn = torch.nn.MSELoss()

    opt = make_optimizer(model.parameters(), c)
    losses = []
    for s in range(steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(s, c)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x[s]), y[s])
        loss.backward()
        if c["max_norm"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c["max_norm"])
        opt.step()
        losses.append(loss.item())

    final = torch.cat([t.detach().reshape(-1) for t in model.state_dict().values()])
    final.numpy().astype("<f4").tofile(os.path.join(d, "params_final.f32"))
    np.array(losses, dtype="<f8").tofile(os.path.join(d, "losses.f64"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
