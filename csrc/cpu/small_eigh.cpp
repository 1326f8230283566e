// Eigendecomposition of many small symmetric matrices at once (cyclic Jacobi), for the router's key gates:
// a 32 x 32 Gram matrix per span, KV head and layer. LAPACK (torch.linalg.eigh) solves them one by one at
// ~60-80 us each on this project's CPUs; here 16 matrices share every instruction (one per SIMD lane:
// the loops over the lane are the innermost and auto-vectorise) and groups of 16 run in parallel.
// Reference: torch.linalg.eigh (tests/ops/test_small_eigh.py).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

constexpr int W = 16;  // matrices per group: one per float lane of an AVX-512 register

// One group: a[n][n][W] symmetric, only its upper triangle (i <= j) read and kept current (its diagonal ends
// as the eigenvalues); vt[n][n][W] the eigenvectors as rows (row i = eigenvector i, so a rotation touches
// two contiguous rows). Sweeps until every lane's off-diagonal mass is below `tol` of its total, or
// `max_sweeps`; a rotation is skipped when every lane's a_pq is below float32 rounding beside a_pp and a_qq
// (late sweeps then cost little).
void jacobi_group(float* a, float* vt, int n, int max_sweeps, float tol) {
  auto A = [&](int i, int j) { return a + (static_cast<int64_t>(i) * n + j) * W; };
  auto VT = [&](int i, int j) { return vt + (static_cast<int64_t>(i) * n + j) * W; };
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      for (int l = 0; l < W; ++l) VT(i, j)[l] = i == j ? 1.f : 0.f;
  // (xp, xq) <- (c xp - s xq, s xp + c xq) on every lane
  auto rotate = [](float* xp, float* xq, const float* c, const float* s) {
    for (int l = 0; l < W; ++l) {
      const float p = xp[l], q = xq[l];
      xp[l] = c[l] * p - s[l] * q;
      xq[l] = s[l] * p + c[l] * q;
    }
  };
  for (int sweep = 0; sweep < max_sweeps; ++sweep) {
    float off[W] = {}, total[W] = {};
    for (int i = 0; i < n; ++i)
      for (int j = i; j < n; ++j) {
        const float* x = A(i, j);
        const float weight = i == j ? 1.f : 2.f;
        for (int l = 0; l < W; ++l) {
          const float sq = weight * x[l] * x[l];
          total[l] += sq;
          off[l] += i == j ? 0.f : sq;
        }
      }
    bool done = true;
    for (int l = 0; l < W; ++l) done = done && off[l] <= tol * total[l];
    if (done) break;
    for (int p = 0; p < n - 1; ++p) {
      for (int q = p + 1; q < n; ++q) {
        float* app = A(p, p);
        float* aqq = A(q, q);
        float* apq = A(p, q);
        int live = 0;
        for (int l = 0; l < W; ++l) live |= apq[l] * apq[l] > tol * std::fabs(app[l] * aqq[l]);
        if (!live) continue;
        float c[W], s[W], t[W];
        for (int l = 0; l < W; ++l) {
          // t = tan of the rotation angle that zeroes a_pq (the smaller root); none where a_pq is 0
          const float theta = (aqq[l] - app[l]) / (2.f * apq[l]);
          const float root = 1.f / (std::fabs(theta) + std::sqrt(theta * theta + 1.f));
          const float tl = apq[l] != 0.f ? std::copysign(root, theta) : 0.f;
          const float cl = 1.f / std::sqrt(tl * tl + 1.f);
          t[l] = tl;
          c[l] = cl;
          s[l] = tl * cl;
        }
        // columns p and q of the upper triangle: (k, p) / (k, q) above p, (p, k) / (k, q) between, (p, k) / (q, k) below q
        for (int k = 0; k < p; ++k) rotate(A(k, p), A(k, q), c, s);
        for (int k = p + 1; k < q; ++k) rotate(A(p, k), A(k, q), c, s);
        for (int k = q + 1; k < n; ++k) rotate(A(p, k), A(q, k), c, s);
        for (int l = 0; l < W; ++l) {
          app[l] -= t[l] * apq[l];
          aqq[l] += t[l] * apq[l];
          apq[l] = 0.f;
        }
        for (int k = 0; k < n; ++k) rotate(VT(p, k), VT(q, k), c, s);
      }
    }
  }
}

}  // namespace

// gram: [B, n, n] float32 symmetric. Returns (eigenvalues [B, n], eigenvectors [B, n, n] as columns), in no
// particular order (the caller sorts).
std::vector<torch::Tensor> small_eigh(const torch::Tensor& gram, int64_t max_sweeps, double tol) {
  TORCH_CHECK(gram.dim() == 3 && gram.size(1) == gram.size(2), "small_eigh: gram must be [B, n, n], got ",
              gram.sizes());
  TORCH_CHECK(gram.scalar_type() == torch::kFloat32 && gram.device().is_cpu(),
              "small_eigh: gram must be float32 on the CPU");
  const auto g = gram.contiguous();
  const int64_t B = g.size(0);
  const int n = static_cast<int>(g.size(1));
  auto evals = torch::empty({B, n}, g.options());
  auto vecs = torch::empty({B, n, n}, g.options());
  const float* src = g.data_ptr<float>();
  float* out_e = evals.data_ptr<float>();
  float* out_v = vecs.data_ptr<float>();
  const int64_t groups = (B + W - 1) / W;
  const int64_t nn = static_cast<int64_t>(n) * n;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> a(nn * W), v(nn * W);
    for (int64_t grp = g0; grp < g1; ++grp) {
      const int64_t b0 = grp * W;
      const int lanes = static_cast<int>(std::min<int64_t>(W, B - b0));
      for (int64_t e = 0; e < nn; ++e)
        for (int l = 0; l < W; ++l)  // lanes past the batch hold the identity (converged from the start)
          a[e * W + l] = l < lanes ? src[(b0 + l) * nn + e] : (e / n == e % n ? 1.f : 0.f);
      jacobi_group(a.data(), v.data(), n, static_cast<int>(max_sweeps), static_cast<float>(tol));
      for (int l = 0; l < lanes; ++l) {
        for (int i = 0; i < n; ++i) out_e[(b0 + l) * n + i] = a[(static_cast<int64_t>(i) * n + i) * W + l];
        for (int i = 0; i < n; ++i)  // vt's row j is eigenvector j: the output's column j
          for (int j = 0; j < n; ++j) out_v[(b0 + l) * nn + i * n + j] = v[(static_cast<int64_t>(j) * n + i) * W + l];
      }
    }
  });
  return {evals, vecs};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_eigh", &small_eigh, "eigendecomposition of many small symmetric matrices (cyclic Jacobi)",
        py::arg("gram"), py::arg("max_sweeps"), py::arg("tol"));
}
