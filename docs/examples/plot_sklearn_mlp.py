"""
A scikit-learn MLP trained by onnxruntime, tuned with GridSearchCV
==================================================================

:class:`ortbridge.training.OnnxSGDRegressor` is a scikit-learn estimator
around an ONNX model: ``fit`` appends the loss to the graph and runs each
epoch as one onnxruntime call (forward, loss, backward and the SGD update of
every batch inside an ONNX ``Loop``). Its parameters and update rule are
``MLPRegressor``'s, so a network converted from scikit-learn with skl2onnx
trains exactly as scikit-learn would train it.

This example converts an ``MLPRegressor``, then

1. continues its training for the same epochs with scikit-learn's
   ``partial_fit`` and with ``OnnxSGDRegressor``: same losses, different time;
2. tunes the learning rate and the momentum with ``GridSearchCV``, for both
   estimators.
"""

# %%
# A scikit-learn MLP and its ONNX conversion
# ------------------------------------------
#
# One epoch of ``MLPRegressor`` initialises the network (``max_iter=1`` warns
# that it has not converged, which is the point). skl2onnx writes float32.

import copy
import time
import warnings

import matplotlib.pyplot as plt
import numpy as np
from skl2onnx import to_onnx
from sklearn.datasets import make_friedman1
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import GridSearchCV, train_test_split
from sklearn.neural_network import MLPRegressor
from sklearn.preprocessing import StandardScaler

from ortbridge.training import OnnxSGDRegressor

warnings.filterwarnings("ignore", category=ConvergenceWarning)

X, y = make_friedman1(n_samples=2000, n_features=10, noise=0.3, random_state=0)
X = StandardScaler().fit_transform(X).astype(np.float32)
y = ((y - y.mean()) / y.std()).astype(np.float32)
X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.25, random_state=0)

HYPER = dict(
    solver="sgd",
    hidden_layer_sizes=(32, 16),
    learning_rate_init=0.01,
    momentum=0.9,
    nesterovs_momentum=True,
    batch_size=16,
    shuffle=False,
    random_state=0,
    n_iter_no_change=1000,  # no early stop: both run every epoch
)
mlp = MLPRegressor(max_iter=1, **HYPER).fit(X_train, y_train)
mlp_onnx = to_onnx(mlp, X_train[:1], target_opset=18)
print("ONNX nodes:", [node.op_type for node in mlp_onnx.graph.node])

# %%
# The same epochs, two ways
# -------------------------
#
# ``OnnxSGDRegressor`` starts from the converted weights with zero
# velocities. scikit-learn goes on from the same network with
# ``warm_start=True``, which keeps the weights and also starts a new SGD
# optimizer. Without shuffling, both see the same batches in the same order,
# so their losses should agree to float32 rounding.
#
# Each fit runs twice: the first ``OnnxSGDRegressor.fit`` of a process also
# loads onnxruntime and builds the training graphs.

EPOCHS = 40


def fit_sklearn():
    reference = copy.deepcopy(mlp).set_params(warm_start=True, max_iter=EPOCHS)
    return reference.fit(X_train, y_train)


def fit_ours():
    return OnnxSGDRegressor(
        mlp_onnx,
        learning_rate_init=HYPER["learning_rate_init"],
        momentum=HYPER["momentum"],
        nesterovs_momentum=HYPER["nesterovs_momentum"],
        alpha=mlp.alpha,  # MLPRegressor's L2 penalty (default 1e-4)
        batch_size=HYPER["batch_size"],
        shuffle=False,
        max_iter=EPOCHS,
    ).fit(X_train, y_train)


timings = {}
for name, fit in (("MLPRegressor", fit_sklearn), ("OnnxSGDRegressor", fit_ours)):
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        fitted = fit()
        seconds.append(time.perf_counter() - start)
    timings[name] = (fitted, seconds)

reference, (sklearn_first, sklearn_seconds) = timings["MLPRegressor"]
ours, (ours_first, ours_seconds) = timings["OnnxSGDRegressor"]
sklearn_losses = reference.loss_curve_[1:]  # the first entry is the initial epoch

columns = ("1st fit (s)", "2nd fit (s)", "last loss", "test R2")
print(f"{'estimator':18s} {columns[0]:>11s} {columns[1]:>11s} {columns[2]:>10s} {columns[3]:>8s}")
for name, (model, seconds) in timings.items():
    loss = model.loss_curve_[-1] if name == "MLPRegressor" else model.train_losses_[-1]
    print(
        f"{name:18s} {seconds[0]:11.2f} {seconds[1]:11.2f} {loss:10.6f} "
        f"{model.score(X_test, y_test):8.4f}"
    )
gap = np.max(np.abs(np.array(ours.train_losses_) - np.array(sklearn_losses)))
print(f"largest difference of the epoch losses: {gap:.1e}")
print(f"time ratio, second fits (ours / scikit-learn): {ours_seconds / sklearn_seconds:.2f}")

# %%
# Tuning with GridSearchCV
# ------------------------
#
# ``OnnxSGDRegressor`` clones, takes ``set_params`` and scores like any
# scikit-learn regressor, so model selection works unchanged. Each candidate
# trains the converted network (starting from its weights) for 20 epochs with
# shuffled batches; scikit-learn's ``MLPRegressor`` searches the same grid from
# its own initialisation (the same random draw, one epoch earlier), for one
# more epoch.

grid = {"learning_rate_init": [0.003, 0.01, 0.03], "momentum": [0.0, 0.9]}
searches = {}
for name, estimator in (
    ("MLPRegressor", MLPRegressor(**{**HYPER, "shuffle": True, "max_iter": 21})),
    (
        "OnnxSGDRegressor",
        OnnxSGDRegressor(mlp_onnx, alpha=mlp.alpha, batch_size=16, max_iter=20, random_state=0),
    ),
):
    search = GridSearchCV(estimator, grid, cv=3)
    start = time.perf_counter()
    search.fit(X_train, y_train)
    searches[name] = (search, time.perf_counter() - start)

print(f"{'learning_rate_init':>18s} {'momentum':>8s}", end="")
for name in searches:
    print(f" {name + ' CV R2':>22s}", end="")
print()
for i, params in enumerate(searches["OnnxSGDRegressor"][0].cv_results_["params"]):
    print(f"{params['learning_rate_init']:18.3f} {params['momentum']:8.1f}", end="")
    for search, _ in searches.values():
        print(f" {search.cv_results_['mean_test_score'][i]:22.4f}", end="")
    print()
for name, (search, seconds) in searches.items():
    print(
        f"{name}: {seconds:.1f} s for {len(search.cv_results_['params']) * 3 + 1} fits, "
        f"best {search.best_params_}, test R2 {search.score(X_test, y_test):.4f}"
    )

# %%
# Losses and times
# ----------------

fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(10, 4))
epochs = np.arange(2, EPOCHS + 2)
ax_loss.plot(epochs, sklearn_losses, "C0-", lw=4, alpha=0.4, label="MLPRegressor.partial_fit")
ax_loss.plot(epochs, ours.train_losses_, "C1--", label="OnnxSGDRegressor")
ax_loss.set_xlabel("epoch")
ax_loss.set_ylabel("training loss (half squared error)")
ax_loss.set_yscale("log")
ax_loss.legend()

labels = [f"fit, {EPOCHS} epochs (2nd)", "GridSearchCV"]
sklearn_times = [sklearn_seconds, searches["MLPRegressor"][1]]
ours_times = [ours_seconds, searches["OnnxSGDRegressor"][1]]
pos = np.arange(len(labels))
ax_time.bar(pos - 0.2, sklearn_times, 0.4, label="scikit-learn")
ax_time.bar(pos + 0.2, ours_times, 0.4, label="OnnxSGDRegressor")
ax_time.set_xticks(pos, labels)
ax_time.set_ylabel("seconds")
ax_time.legend()
fig.suptitle("MLP (10 -> 32 -> 16 -> 1) on Friedman #1, batches of 16")
fig.tight_layout()
plt.show()
