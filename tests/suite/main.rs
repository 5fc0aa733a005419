//! The integration tests in one binary, so the library is linked once for all of them rather
//! than once per file. The harness is common/harness.rs; each module lists its tests at its end.
//! The MPI and multi-host tests are the `mpi` binary's (tests/mpi/main.rs).

#[macro_use]
mod common;

mod avgpool;
mod batchnorm;
mod batchnorm_by_plane;
mod batchnorm_errors;
mod bench;
mod collective;
mod conv2d;
mod cross_entropy;
mod data;
mod dense;
mod elementwise;
mod export;
mod gpu_errors;
mod matmul;
mod maxpool;
mod messages;
mod parallel;
mod plot;
mod pretrained;
mod pytorch;
mod readback;
mod reliability;
mod selfcheck;
mod sgd;
mod side_files;
mod step;
mod train;
mod trust;

fn main() -> std::process::ExitCode {
    common::harness::main(&[
        avgpool::TESTS,
        batchnorm::TESTS,
        batchnorm_by_plane::TESTS,
        batchnorm_errors::TESTS,
        bench::TESTS,
        collective::TESTS,
        conv2d::TESTS,
        cross_entropy::TESTS,
        data::TESTS,
        dense::TESTS,
        elementwise::TESTS,
        export::TESTS,
        gpu_errors::TESTS,
        matmul::TESTS,
        maxpool::TESTS,
        messages::TESTS,
        parallel::TESTS,
        plot::TESTS,
        pretrained::TESTS,
        pytorch::TESTS,
        readback::TESTS,
        reliability::TESTS,
        selfcheck::TESTS,
        sgd::TESTS,
        side_files::TESTS,
        step::TESTS,
        train::TESTS,
        trust::TESTS,
    ])
}
