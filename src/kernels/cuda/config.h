// Tile shapes of the CUDA kernels, per head dim: the one place they are chosen.
#pragma once

namespace ringflash::cuda {

struct ForwardTiles {
  int block_m;  // queries per thread block
  int block_n;  // keys per main-loop step
  int warps;    // each warp owns block_m / warps query rows
};

constexpr ForwardTiles forward_tiles(int head_dim) {
  return head_dim <= 64 ? ForwardTiles{128, 128, 4} : head_dim <= 128 ? ForwardTiles{128, 64, 4} : ForwardTiles{64, 64, 4};
}

struct BackwardTiles {
  int block_m;    // queries per inner step
  int block_n;    // keys per thread block (16 per warp)
  int warps;
  int dim_parts;  // dK/dV columns are split over this many blocks (register budget at hdim 256)
  int stages;     // shared-memory buffers for the q/dout tiles
};

constexpr BackwardTiles backward_tiles(int head_dim) {
  return head_dim <= 128 ? BackwardTiles{64, 128, 8, 1, 2} : BackwardTiles{64, 64, 4, 2, 1};
}

}  // namespace ringflash::cuda
