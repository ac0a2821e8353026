// fp8_block on SM90: CUTLASS's blockwise-scaled ptr-array mainloop with our own consumer loop.
//
// Every 128 of K the fp32 partial sums of the tensor cores must be multiplied by that k
// block's scales (per activation row x per 128x128 weight block) and added to the result.
// CUTLASS's loop waits for all of a k block's wgmmas (warpgroup_wait<0>) before it scales
// them, so each warpgroup's tensor-core work stops for the wait, the scale loads and the 64
// FMAs of every k block. This loop keeps two partial-sum buffers: it issues k block i into
// one, then waits only for block i - 1 (warpgroup_wait<1>) and scales that one while block
// i's wgmmas run. 64x128 per warpgroup: 3 x 64 fp32 accumulator registers.
//
// Everything else (TMA loads of A/B, cp.async of the scales, tensormap updates per group,
// shared-memory layout, pipeline contract: k blocks 0 .. n-2 released here, n-1 by
// mma_tail) is the base collective's.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace moe_kernels::sm90 {

template <class Base>
struct OverlappedBlockwiseMma : Base {
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::Params;
  using typename Base::TiledMma;
  using typename Base::TileShape;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::SmemLayoutSFA;
  using typename Base::SmemLayoutSFB;
  using typename Base::ElementBlockScale;

  // One scale per activation row and one per weight block in a tile; one promotion per k tile.
  static_assert(Base::ScaleGranularityM == 1 && Base::ScaleNsPerTile == 1,
                "per-row A scales and tile_n of one 128-column weight block");
  static_assert(cute::size<2>(TileShape{}) == Base::ScaleGranularityK, "tile_k == scale block");

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                          FrgTensorC& accum, int k_tile_count, int thread_idx,
                          TensorStorage& shared_tensors, Params const&) {
    using namespace cute;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    // Scales seen as (BLK_M, BLK_N, (BLK_K, PIPE)) with zero strides where they broadcast,
    // so the accumulator's partition gives each thread the scales of its own elements.
    Tensor sSFA = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFA.data()),
        make_layout(make_shape(shape<0>(SmemLayoutSFA{}), get<1>(TileShape{}),
                               make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
                    make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                                make_stride(stride<1>(SmemLayoutSFA{}), stride<2>(SmemLayoutSFA{})))));
    Tensor sSFB = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFB.data()),
        make_layout(make_shape(get<0>(TileShape{}), shape<0>(SmemLayoutSFB{}),
                               make_shape(shape<1>(SmemLayoutSFB{}), shape<2>(SmemLayoutSFB{}))),
                    make_stride(_0{}, stride<0>(SmemLayoutSFB{}),
                                make_stride(stride<1>(SmemLayoutSFB{}), stride<2>(SmemLayoutSFB{})))));

    TiledMma tiled_mma;
    constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    const int wg = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    auto wg_mma = tiled_mma.get_slice(make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{})(wg));
    Tensor tCrA = wg_mma.make_fragment_A(wg_mma.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
    Tensor tCrB = wg_mma.make_fragment_B(wg_mma.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)
    auto thr_mma = tiled_mma.get_slice(thread_idx);
    Tensor tCsSFA = thr_mma.partition_C(sSFA);  // (MMA, MMA_M, MMA_N, (MMA_K, PIPE))
    Tensor tCsSFB = thr_mma.partition_C(sSFB);

    Tensor part0 = make_fragment_like(accum);
    Tensor part1 = make_fragment_like(accum);
    Tensor sfa0 = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));
    Tensor sfa1 = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));
    Tensor sfb = make_tensor_like<ElementBlockScale>(tCsSFB(_, _, _, _0{}));

    clear(accum);
    if (k_tile_count <= 0) return;

    // Wait for a k tile's stage, read its scales (row scale x block scale) and issue its
    // wgmmas into `part` (zeroing it with the first).
    auto issue = [&](auto& part, auto& sfa) {
      pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
      const int stage = smem_pipe_read.index();
      warpgroup_fence_operand(part);
      warpgroup_arrive();
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < size<2>(tCrA); ++k) {
        cute::gemm(tiled_mma, tCrA(_, _, k, stage), tCrB(_, _, k, stage), part);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(part);
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), sfa);
      copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), sfb);
      const ElementBlockScale b = sfb(_0{});
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(filter_zeros(sfa)); ++i) filter_zeros(sfa)(i) *= b;
      ++smem_pipe_read;
    };
    // After warpgroup_wait: add a finished k tile's partial sums, scaled.
    auto promote = [&](auto& part, auto const& sfa) {
      warpgroup_fence_operand(part);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) accum(i) += part(i) * sfa(i);
    };

    PipelineState smem_pipe_release = smem_pipe_read;
    // Wait for k tile i - 1 (in `prev`) while tile i runs, release its stage and scale it.
    auto retire = [&](auto& prev, auto const& sfa_prev) {
      warpgroup_wait<1>();
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_release;
      promote(prev, sfa_prev);
    };
    // Nothing is in flight where the loop starts, so no wgmma-written register is carried
    // into it from outside (ptxas would insert a full wait there).
    CUTLASS_PRAGMA_NO_UNROLL
    for (int i = 0;; i += 2) {
      issue(part0, sfa0);
      if (i > 0) retire(part1, sfa1);
      if (i + 1 == k_tile_count) {
        warpgroup_wait<0>();
        promote(part0, sfa0);
        break;
      }
      issue(part1, sfa1);
      retire(part0, sfa0);
      if (i + 2 == k_tile_count) {
        warpgroup_wait<0>();
        promote(part1, sfa1);
        break;
      }
    }
    warpgroup_fence_operand(accum);
  }
};

}  // namespace moe_kernels::sm90
