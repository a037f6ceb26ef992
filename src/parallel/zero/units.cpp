// ZeRO-3's units: gathering and releasing them (units.h).
#include "units.h"

namespace tandem::parallel::detail::zero {

// Note [Freeing a unit]: the parameters of a released unit keep their TensorImpls (the
// optimizer, autograd's saved tensors and the model all hold them) and their sizes; only the
// storage they share with `flat` gives its bytes back (nbytes 0). gather() allocates the storage
// again and all-gathers the chunks into it, so every tensor that aliases it, saved ones
// included, sees the parameters again. Nothing reads a released unit's parameters: a Sharded
// module gathers before its forward and before its backward.
// Gives `flat`'s storage `numel` elements again (contents undefined), or (0) takes its bytes.
void set_storage_numel(const at::Tensor& flat, int64_t numel) {
  auto* storage = flat.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(numel) * flat.element_size();
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

// Gives a released unit its storage back (contents undefined).
void materialize_unit(Unit& u) {
  set_storage_numel(u.flat, u.padded);
  u.gathered = true;
}

// Note [Prefetching units]: start_gather gives the unit its storage and issues its all-gather;
// finish_gather waits for it. Whatever reads or frees a unit's storage finishes its gather
// first, so a prefetched unit is never freed (nor read) while the all-gather writes into it.
void start_gather(Unit& u, ProcessGroup& pg) {
  if (u.gathered) return;
  materialize_unit(u);
  at::NoGradGuard no_grad;
  at::Tensor src = u.shard_param.detach();
  if (src.scalar_type() != u.flat.scalar_type() || src.device() != u.flat.device())
    src = src.to(u.flat.options());
  if (pg.size() > 1) {
    u.gathering = pg.all_gather_into_async(src, u.flat);
    u.in_flight = true;
    u.prefetched = false;
    u.issued = std::chrono::steady_clock::now();
  } else {
    u.flat.copy_(src);
  }
}

void finish_gather(Unit& u, CommLog* log) {
  if (!u.in_flight) return;
  const auto begin = std::chrono::steady_clock::now();
  const bool done_before = u.gathering.completed();
  u.gathering.wait();
  u.gathering = Work();  // the collective's buffers (the list form's parts) go with it
  u.in_flight = false;
  const auto end = std::chrono::steady_clock::now();
  if (log) {
    log->add("all-gather unit " + std::to_string(u.bucket) +
                 (u.prefetched ? " (prefetched)" : ""),
             u.issued, done_before ? begin : end, false);
    if (!done_before) log->add("wait for all-gather", begin, end, true);
  }
}

void gather_unit(Unit& u, ProcessGroup& pg, CommLog* log) {
  start_gather(u, pg);
  finish_gather(u, log);
}

void release_unit(Unit& u) {
  finish_gather(u);
  if (u.resident || !u.gathered) return;
  set_storage_numel(u.flat, 0);
  u.gathered = false;
}

// A tensor of `sizes` at `offset` of `flat`'s storage, made without giving the storage its bytes
// (set_ would: a released storage has none): what a released unit's parameter is.
at::Tensor released_alias(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes) {
  at::Tensor t = at::empty({0}, flat.options());
  t.set_(flat.storage());  // zero elements of the (empty) storage
  auto* impl = t.unsafeGetTensorImpl();
  impl->set_storage_offset(flat.storage_offset() + offset);
  impl->set_sizes_contiguous(sizes);
  return t;
}

void gather_built(BuiltUnit& b, ProcessGroup& pg) {
  if (b.gathered) return;
  set_storage_numel(b.flat, b.padded);
  at::NoGradGuard no_grad;
  if (pg.size() > 1)
    pg.all_gather_into(b.chunk, b.flat);
  else
    b.flat.copy_(b.chunk);
  b.gathered = true;
}

}  // namespace tandem::parallel::detail::zero
